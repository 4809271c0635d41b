//! Python face of the planner: `ModelShape`, `Limits`, `Features`,
//! `PlanInput`, `plan_memory`, `MemoryPlan`; a plan that does not fit
//! raises `PlanFailure` with its report and arithmetic (`errors.rs`).
//!
//! Every rule is the core's (`imp_mem_core::planner`); this file converts
//! arguments so that bad input is an `InvalidArgument` naming the field.

use std::path::PathBuf;

use imp_mem_core::planner::{
    self as core, Dtype, KvPolicy, DEFAULT_BLOCK_SIZE, H200_CONTEXT_BYTES,
    H200_LIBRARY_RESERVE_BYTES,
};
use imp_mem_core::MemError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::convert;
use crate::errors::{invalid, IntoPyResult};

/// Serialises a core value and hands it to Python as plain dicts and lists.
fn to_py_object<T: serde::Serialize>(py: Python<'_>, value: &T) -> PyResult<Py<PyAny>> {
    let text = serde_json::to_string(value)
        .map_err(|err| MemError::Invariant(format!("planner value does not serialise: {err}")))
        .py()?;
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

/// A Python dict (or anything `json.dumps` accepts) as a JSON value.
fn from_py_json(value: &Bound<'_, PyAny>, what: &str) -> PyResult<serde_json::Value> {
    let text: String = value
        .py()
        .import("json")?
        .call_method1("dumps", (value,))
        .map_err(|err| invalid(format!("{what}: not JSON-serialisable: {err}")))?
        .extract()?;
    serde_json::from_str(&text).map_err(|err| invalid(format!("{what}: {err}")))
}

/// A byte count: an int, or text such as `"80GiB"`; errors name `what`.
fn size(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    match value.cast::<PyString>() {
        Ok(_) => {
            let text = convert::text(value, what)?;
            core::parse_size(&text, what)
                .map_err(|e| invalid(format!("{e}{}", convert::int_hint(&text))))
        }
        Err(_) => convert::bytes(value, what),
    }
}

/// An optional byte count (None or absent gives `None`).
fn opt_size(value: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u64>> {
    value
        .filter(|v| !v.is_none())
        .map(|v| size(v, what))
        .transpose()
}

fn to_u32(value: u64, what: &str) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| invalid(format!("{what}: {value} is too large")))
}

fn positive(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    // A negative count gets the same words as 0: at least 1.
    if value.lt(0).unwrap_or(false) {
        return Err(invalid(format!("{what}: must be at least 1, got {value}")));
    }
    let n = convert::index(value, what)?;
    if n == 0 {
        return Err(invalid(format!("{what}: must be at least 1, got 0")));
    }
    Ok(n)
}

fn opt_dtype(value: Option<&str>, what: &str) -> PyResult<Option<Dtype>> {
    match value {
        None | Some("auto") => Ok(None),
        Some(text) => Dtype::parse(text, what).map(Some).py(),
    }
}

/// An `ImpMemWarning` for a shape whose `model_type` the planner does not
/// know (`core::unknown_model_type`: planned, with the warning).
fn warn_unknown_model_type(py: Python<'_>, shape: &core::ModelShape) -> PyResult<()> {
    if let Some(message) = core::unknown_model_type(&shape.name) {
        let category = py.get_type::<crate::errors::ImpMemWarning>();
        PyErr::warn(py, &category, &std::ffi::CString::new(message)?, 2)?;
    }
    Ok(())
}

/// What a model costs: layers by kind, attention geometry, state, experts,
/// weight formats. Build it from a Hugging Face config with
/// `ModelShape.from_hf_config(path_or_dict)`, or pass config.json fields as
/// keyword arguments: `ModelShape(num_hidden_layers=32, hidden_size=4096, ...)`.
#[pyclass(frozen, name = "ModelShape", module = "imp_mem._core")]
#[derive(Clone)]
pub struct PyModelShape {
    inner: core::ModelShape,
}

#[pymethods]
impl PyModelShape {
    #[new]
    #[pyo3(signature = (**fields))]
    fn new(fields: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let Some(fields) = fields else {
            return Err(invalid(
                "ModelShape: pass config.json fields (num_hidden_layers=..., hidden_size=..., ...) \
                 or use ModelShape.from_hf_config(path_or_dict)",
            ));
        };
        let names: Vec<String> = fields.keys().extract()?;
        core::check_fields(names.iter().map(String::as_str)).py()?;
        let value = from_py_json(fields.as_any(), "ModelShape")?;
        let inner = core::ModelShape::from_hf_config(&value).py()?;
        warn_unknown_model_type(fields.py(), &inner)?;
        Ok(Self { inner })
    }

    /// Reads a Hugging Face `config.json`: a path (file or checkpoint
    /// directory; safetensors beside it give the real weight bytes) or an
    /// already-loaded dict. `weights_bytes` overrides the weight estimate.
    #[staticmethod]
    #[pyo3(signature = (path_or_dict, *, weights_bytes = None))]
    fn from_hf_config(
        path_or_dict: &Bound<'_, PyAny>,
        weights_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let shape = if path_or_dict.is_instance_of::<PyDict>() {
            let value = from_py_json(path_or_dict, "config")?;
            core::ModelShape::from_hf_config(&value).py()?
        } else if let Ok(path) = path_or_dict.extract::<PathBuf>() {
            core::ModelShape::from_hf_config_path(&path).py()?
        } else {
            return Err(invalid(format!(
                "config: expected a path to config.json or a dict, got {}",
                path_or_dict.get_type().name()?
            )));
        };
        warn_unknown_model_type(path_or_dict.py(), &shape)?;
        let shape = match opt_size(weights_bytes, "weights_bytes")? {
            Some(bytes) => shape.with_measured_weights(bytes),
            None => shape,
        };
        Ok(Self { inner: shape })
    }

    /// A shipped preset's shape, by its name or its Hugging Face id
    /// (`imp_mem.presets()` lists them; `imp-mem plan --list-presets`); an
    /// unknown name is refused with the nearest ones. The presets are data
    /// in `imp_mem._presets`, read through `imp_mem.preset_config`.
    #[staticmethod]
    fn from_preset(py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<Self> {
        let config = py
            .import("imp_mem._presets")?
            .call_method1("preset", (name,))?;
        let value = from_py_json(&config, "preset")?;
        Ok(Self {
            inner: core::ModelShape::from_hf_config(&value).py()?,
        })
    }

    /// The same shape with its weight bytes replaced by a measured figure.
    fn with_weights_bytes(&self, nbytes: &Bound<'_, PyAny>) -> PyResult<Self> {
        let bytes = size(nbytes, "weights_bytes")?;
        Ok(Self {
            inner: self.inner.clone().with_measured_weights(bytes),
        })
    }

    /// The planner's weights line for one of `tp` ranks: `ceil(weights /
    /// tp)` rounded up to a MiB.
    fn rank_weights_line(&self, tp: &Bound<'_, PyAny>) -> PyResult<u64> {
        let tp = to_u32(positive(tp, "tp")?, "tp")?;
        Ok(self.inner.rank_weights_line(tp))
    }

    /// The shape `tp` ranks plan with when the largest rank's load lays out
    /// `largest_rank` bytes: this one while its per-rank line covers them,
    /// else one whose weights are `tp * largest_rank`.
    fn for_rank_layout(
        &self,
        tp: &Bound<'_, PyAny>,
        largest_rank: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let tp = to_u32(positive(tp, "tp")?, "tp")?;
        let need = size(largest_rank, "largest_rank")?;
        Ok(Self {
            inner: self.inner.clone().for_rank_layout(tp, need),
        })
    }

    /// Raises InvalidArgument when the attention heads do not split evenly
    /// over `tp` ranks (the planner's rule; the message names the nearest
    /// degrees that do).
    fn check_tp(&self, tp: &Bound<'_, PyAny>) -> PyResult<()> {
        let tp = to_u32(positive(tp, "tp")?, "tp")?;
        self.inner.check_tp(tp).py()
    }

    /// KV bytes one token costs on one of `tp` ranks:
    /// `{"full": ..., "sliding": ..., "total": ...}`.
    #[pyo3(signature = (kv_dtype = None, tp = None))]
    fn kv_bytes_per_token<'py>(
        &self,
        py: Python<'py>,
        kv_dtype: Option<&Bound<'py, PyAny>>,
        tp: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let kv_dtype = convert::opt(kv_dtype, "kv_dtype", convert::text)?;
        let dtype = opt_dtype(kv_dtype.as_deref(), "kv_dtype")?.unwrap_or(self.inner.dtype);
        let tp = match tp {
            Some(t) => to_u32(positive(t, "tp")?, "tp")?,
            None => 1,
        };
        let kv = self.inner.kv_bytes_per_token(dtype, tp);
        let out = PyDict::new(py);
        out.set_item("full", kv.full)?;
        out.set_item("sliding", kv.sliding)?;
        out.set_item("total", kv.total())?;
        Ok(out)
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.num_layers
    }
    #[getter]
    fn hidden_size(&self) -> u64 {
        self.inner.hidden_size
    }
    #[getter]
    fn vocab_size(&self) -> u64 {
        self.inner.vocab_size
    }
    #[getter]
    fn num_attention_heads(&self) -> u64 {
        self.inner.num_attention_heads
    }
    /// `"gqa"` or `"mla"`.
    #[getter]
    fn attention_kind(&self) -> &'static str {
        match self.inner.attention {
            core::Attention::Gqa { .. } => "gqa",
            core::Attention::Mla { .. } => "mla",
        }
    }
    /// The attention geometry as a dict.
    #[getter]
    fn attention(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner.attention)
    }
    #[getter]
    fn full_attention_layers(&self) -> u32 {
        self.inner.full_attention_layers
    }
    #[getter]
    fn sliding_layers(&self) -> u32 {
        self.inner.sliding_layers
    }
    #[getter]
    fn sliding_window(&self) -> Option<u64> {
        self.inner.sliding_window
    }
    #[getter]
    fn state_layers(&self) -> u32 {
        self.inner.state_layers
    }
    #[getter]
    fn state_bytes_per_layer(&self) -> u64 {
        self.inner.state_bytes_per_layer
    }
    /// The MoE layout as a dict, or None.
    #[getter]
    fn moe(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner.moe)
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    /// Parameters counted from the shape.
    #[getter]
    fn params(&self) -> u64 {
        self.inner.weights.params()
    }
    /// Weight bytes of the whole model: measured if known, else estimated.
    #[getter]
    fn weights_bytes(&self) -> u64 {
        self.inner.weights_bytes()
    }
    /// `{"dense": ..., "experts": ..., "embeddings": ...}` weight formats.
    #[getter]
    fn weight_formats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let w = &self.inner.weights;
        let out = PyDict::new(py);
        out.set_item("embeddings", w.embedding_format.name())?;
        out.set_item("dense", w.dense_format.name())?;
        out.set_item("experts", w.expert_format.name())?;
        Ok(out)
    }
    #[getter]
    fn max_position_embeddings(&self) -> Option<u64> {
        self.inner.max_position_embeddings
    }

    /// The shape as JSON.
    fn to_json(&self) -> PyResult<String> {
        self.inner.to_json().py()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<Self>()
            .is_ok_and(|o| o.get().inner == self.inner)
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        format!(
            "ModelShape(name={:?}, layers={} (full {}, sliding {}, state {}), attention={}, \
             dtype={}, weights={})",
            m.name,
            m.num_layers,
            m.full_attention_layers,
            m.sliding_layers,
            m.state_layers,
            self.attention_kind(),
            m.dtype,
            imp_mem_core::units::human_bytes(m.weights_bytes())
        )
    }
}

/// The concurrency a plan must serve.
#[pyclass(frozen, name = "Limits", module = "imp_mem._core")]
#[derive(Clone)]
pub struct PyLimits {
    inner: core::Limits,
}

#[pymethods]
impl PyLimits {
    #[new]
    #[pyo3(
        signature = (max_batch, max_seq_len, *, kv_dtype = None, block_size = None,
                     max_batch_tokens = None, kv_policy = None),
        text_signature = "(max_batch, max_seq_len, *, kv_dtype=None, block_size=None, \
                          max_batch_tokens=None, kv_policy='full')"
    )]
    fn new(
        max_batch: &Bound<'_, PyAny>,
        max_seq_len: &Bound<'_, PyAny>,
        kv_dtype: Option<&Bound<'_, PyAny>>,
        block_size: Option<&Bound<'_, PyAny>>,
        max_batch_tokens: Option<&Bound<'_, PyAny>>,
        kv_policy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let kv_dtype = convert::opt(kv_dtype, "kv_dtype", convert::text)?;
        let kv_dtype = kv_dtype.as_deref();
        let kv_policy = convert::opt(kv_policy, "kv_policy", convert::text)?;
        let kv_policy = kv_policy.as_deref().unwrap_or("full");
        let block_size = match block_size.filter(|b| !b.is_none()) {
            Some(b) => to_u32(positive(b, "block_size")?, "block_size")?,
            None => DEFAULT_BLOCK_SIZE,
        };
        let max_batch_tokens = match max_batch_tokens.filter(|b| !b.is_none()) {
            Some(t) => Some(positive(t, "max_batch_tokens")?),
            None => None,
        };
        Ok(Self {
            inner: core::Limits {
                max_batch: to_u32(positive(max_batch, "max_batch")?, "max_batch")?,
                max_seq_len: positive(max_seq_len, "max_seq_len")?,
                kv_dtype: opt_dtype(kv_dtype, "kv_dtype")?,
                block_size,
                max_batch_tokens,
                kv_policy: KvPolicy::parse(kv_policy).py()?,
            },
        })
    }

    #[getter]
    fn max_batch(&self) -> u32 {
        self.inner.max_batch
    }
    #[getter]
    fn max_seq_len(&self) -> u64 {
        self.inner.max_seq_len
    }
    /// The KV dtype, or None for the model's.
    #[getter]
    fn kv_dtype(&self) -> Option<&'static str> {
        self.inner.kv_dtype.map(Dtype::name)
    }
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size
    }
    #[getter]
    fn max_batch_tokens(&self) -> Option<u64> {
        self.inner.max_batch_tokens
    }
    #[getter]
    fn kv_policy(&self) -> &'static str {
        match self.inner.kv_policy {
            KvPolicy::Full => "full",
            KvPolicy::Fit => "fit",
            KvPolicy::None => "none",
        }
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "Limits(max_batch={}, max_seq_len={}, kv_dtype={}, block_size={}, kv_policy={:?})",
            l.max_batch,
            l.max_seq_len,
            l.kv_dtype.map_or("auto", Dtype::name),
            l.block_size,
            self.kv_policy()
        )
    }
}

/// Features that cost memory beyond the model and its KV.
#[pyclass(frozen, name = "Features", module = "imp_mem._core")]
#[derive(Clone)]
pub struct PyFeatures {
    inner: core::Features,
}

#[pymethods]
impl PyFeatures {
    #[new]
    #[pyo3(signature = (*, spec_depth = None, draft_weights_bytes = None, vision_tower_bytes = None,
                        lora_slots = None, lora_rank = None, scratch_bytes = None,
                        engine_persistent_bytes = None, kv_host_bytes = None,
                        activation_bytes = None, engine_kv_blocks = None,
                        engine_swa_blocks = None, warmup_bytes = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        spec_depth: Option<&Bound<'_, PyAny>>,
        draft_weights_bytes: Option<&Bound<'_, PyAny>>,
        vision_tower_bytes: Option<&Bound<'_, PyAny>>,
        lora_slots: Option<&Bound<'_, PyAny>>,
        lora_rank: Option<&Bound<'_, PyAny>>,
        scratch_bytes: Option<&Bound<'_, PyAny>>,
        engine_persistent_bytes: Option<&Bound<'_, PyAny>>,
        kv_host_bytes: Option<&Bound<'_, PyAny>>,
        activation_bytes: Option<&Bound<'_, PyAny>>,
        engine_kv_blocks: Option<&Bound<'_, PyAny>>,
        engine_swa_blocks: Option<&Bound<'_, PyAny>>,
        warmup_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let count = |v: Option<&Bound<'_, PyAny>>, what: &str| -> PyResult<u32> {
            match v.filter(|v| !v.is_none()) {
                Some(v) => to_u32(convert::index(v, what)?, what),
                None => Ok(0),
            }
        };
        let inner = core::Features {
            spec_depth: count(spec_depth, "spec_depth")?,
            draft_weights_bytes: opt_size(draft_weights_bytes, "draft_weights_bytes")?.unwrap_or(0),
            vision_tower_bytes: opt_size(vision_tower_bytes, "vision_tower_bytes")?.unwrap_or(0),
            lora_slots: count(lora_slots, "lora_slots")?,
            lora_rank: count(lora_rank, "lora_rank")?,
            scratch_bytes: opt_size(scratch_bytes, "scratch_bytes")?,
            engine_persistent_bytes: opt_size(engine_persistent_bytes, "engine_persistent_bytes")?,
            kv_host_bytes: opt_size(kv_host_bytes, "kv_host_bytes")?.unwrap_or(0),
            activation_bytes: opt_size(activation_bytes, "activation_bytes")?,
            engine_kv_blocks: count(engine_kv_blocks, "engine_kv_blocks")?.into(),
            engine_swa_blocks: count(engine_swa_blocks, "engine_swa_blocks")?.into(),
            warmup_bytes: opt_size(warmup_bytes, "warmup_bytes")?.unwrap_or(0),
        };
        if inner.lora_slots > 0 && inner.lora_rank == 0 {
            return Err(invalid("lora_rank: must be at least 1 when lora_slots > 0"));
        }
        Ok(Self { inner })
    }

    #[getter]
    fn spec_depth(&self) -> u32 {
        self.inner.spec_depth
    }
    #[getter]
    fn draft_weights_bytes(&self) -> u64 {
        self.inner.draft_weights_bytes
    }
    #[getter]
    fn vision_tower_bytes(&self) -> u64 {
        self.inner.vision_tower_bytes
    }
    #[getter]
    fn lora_slots(&self) -> u32 {
        self.inner.lora_slots
    }
    #[getter]
    fn lora_rank(&self) -> u32 {
        self.inner.lora_rank
    }
    /// Pinned host bytes for the KV host tier (T5b; not device memory).
    #[getter]
    fn kv_host_bytes(&self) -> u64 {
        self.inner.kv_host_bytes
    }
    #[getter]
    fn scratch_bytes(&self) -> Option<u64> {
        self.inner.scratch_bytes
    }
    #[getter]
    fn engine_persistent_bytes(&self) -> Option<u64> {
        self.inner.engine_persistent_bytes
    }
    #[getter]
    fn activation_bytes(&self) -> Option<u64> {
        self.inner.activation_bytes
    }
    /// KV blocks the engine holds for itself beyond `max_batch` sequences.
    #[getter]
    fn engine_kv_blocks(&self) -> u64 {
        self.inner.engine_kv_blocks
    }
    /// The same for the sliding-window pool.
    #[getter]
    fn engine_swa_blocks(&self) -> u64 {
        self.inner.engine_swa_blocks
    }
    /// What a warm-up leaves outside the tiers, measured (the `warmup` line).
    #[getter]
    fn warmup_bytes(&self) -> u64 {
        self.inner.warmup_bytes
    }

    fn __repr__(&self) -> String {
        let f = &self.inner;
        format!(
            "Features(spec_depth={}, vision_tower_bytes={}, lora_slots={}, lora_rank={})",
            f.spec_depth, f.vision_tower_bytes, f.lora_slots, f.lora_rank
        )
    }
}

/// Everything `plan_memory` reads. `context` and `library_reserve` are the
/// two measured charges (the CUDA context and the library reserve); they
/// default to the H200 measurements (527 MiB and 66 MiB) and should be
/// measured on the target machine.
#[pyclass(frozen, name = "PlanInput", module = "imp_mem._core")]
pub struct PyPlanInput {
    inner: core::PlanInput,
}

#[pymethods]
impl PyPlanInput {
    #[new]
    #[pyo3(signature = (model, limits, features = None, *, budget, tp = None, context = None,
                        library_reserve = None))]
    fn new(
        model: &PyModelShape,
        limits: &PyLimits,
        features: Option<&PyFeatures>,
        budget: &Bound<'_, PyAny>,
        tp: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyAny>>,
        library_reserve: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let budget = size(budget, "budget")?;
        let tp = match tp.filter(|t| !t.is_none()) {
            Some(t) => to_u32(positive(t, "tp")?, "tp")?,
            None => 1,
        };
        let inner = core::PlanInput {
            model: model.inner.clone(),
            limits: limits.inner.clone(),
            features: features.map(|f| f.inner.clone()).unwrap_or_default(),
            tp,
            budget,
            context_bytes: opt_size(context, "context")?.unwrap_or(H200_CONTEXT_BYTES),
            library_reserve_bytes: opt_size(library_reserve, "library_reserve")?
                .unwrap_or(H200_LIBRARY_RESERVE_BYTES),
        };
        inner.validate().py()?;
        Ok(Self { inner })
    }

    #[getter]
    fn model(&self) -> PyModelShape {
        PyModelShape {
            inner: self.inner.model.clone(),
        }
    }
    #[getter]
    fn limits(&self) -> PyLimits {
        PyLimits {
            inner: self.inner.limits.clone(),
        }
    }
    #[getter]
    fn features(&self) -> PyFeatures {
        PyFeatures {
            inner: self.inner.features.clone(),
        }
    }
    #[getter]
    fn budget(&self) -> u64 {
        self.inner.budget
    }
    #[getter]
    fn tp(&self) -> u32 {
        self.inner.tp
    }
    #[getter]
    fn context(&self) -> u64 {
        self.inner.context_bytes
    }
    #[getter]
    fn library_reserve(&self) -> u64 {
        self.inner.library_reserve_bytes
    }

    /// The input as JSON (what `plan_memory` reads).
    fn to_json(&self) -> PyResult<String> {
        self.inner.to_json().py()
    }

    fn __repr__(&self) -> String {
        format!(
            "PlanInput(model={:?}, max_batch={}, max_seq_len={}, tp={}, budget={})",
            self.inner.model.name,
            self.inner.limits.max_batch,
            self.inner.limits.max_seq_len,
            self.inner.tp,
            imp_mem_core::units::human_bytes(self.inner.budget)
        )
    }
}

/// A successful plan: every tier's size on one rank, within the budget.
#[pyclass(frozen, name = "MemoryPlan", module = "imp_mem._core")]
pub struct PyMemoryPlan {
    inner: core::MemoryPlan,
}

impl PyMemoryPlan {
    /// The core plan (for a `MemorySystem`).
    pub(crate) fn core(&self) -> &core::MemoryPlan {
        &self.inner
    }
}

#[pymethods]
impl PyMemoryPlan {
    /// Sum of every charge, bytes.
    fn total(&self) -> u64 {
        self.inner.total()
    }
    /// The plan as JSON; the same input always gives the same bytes (V7).
    fn to_json(&self) -> PyResult<String> {
        self.inner.to_json().py()
    }
    /// The plan as plain dicts and lists.
    fn to_dict(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner)
    }
    /// Reads a plan back from `to_json()`.
    #[staticmethod]
    fn from_json(text: &Bound<'_, PyAny>) -> PyResult<Self> {
        let text = convert::text(text, "text")?;
        Ok(Self {
            inner: core::MemoryPlan::from_json(&text).py()?,
        })
    }
    /// A plan of the activations tier alone: `activations` bytes (rounded
    /// up to a MiB) and the CUDA `context`, within `budget`; no model, no
    /// KV pool, no scratch.
    #[staticmethod]
    fn activations_only(
        budget: &Bound<'_, PyAny>,
        context: &Bound<'_, PyAny>,
        activations: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let budget = convert::index(budget, "budget")?;
        let context = convert::index(context, "context")?;
        let activations = convert::index(activations, "activations")?;
        Ok(Self {
            inner: core::MemoryPlan::activations_only(budget, context, activations).py()?,
        })
    }
    /// The largest activations tier (whole MiB) that fits in `budget`
    /// beside a CUDA context of `context` bytes; 0 when none does.
    #[staticmethod]
    fn activations_room(budget: &Bound<'_, PyAny>, context: &Bound<'_, PyAny>) -> PyResult<u64> {
        let budget = convert::index(budget, "budget")?;
        let context = convert::index(context, "context")?;
        Ok(core::MemoryPlan::activations_room(budget, context))
    }
    /// The charges as a text table in MiB.
    fn table(&self) -> String {
        self.inner.table()
    }
    #[getter]
    fn budget(&self) -> u64 {
        self.inner.budget
    }
    #[getter]
    fn tp(&self) -> u32 {
        self.inner.tp
    }
    /// T1: weights + vision tower + draft model.
    #[getter]
    fn model_resident(&self) -> u64 {
        self.inner.model_resident
    }
    #[getter]
    fn weights(&self) -> u64 {
        self.inner.weights
    }
    /// T5b, host side: pinned host bytes a level-1 sleep holds (T1's copy).
    #[getter]
    fn sleep_host(&self) -> u64 {
        self.inner.sleep_host
    }
    /// T2: workspaces, logits, block tables, LoRA.
    #[getter]
    fn engine_persistent(&self) -> u64 {
        self.inner.engine_persistent
    }
    /// T4: forward-pass scratch high-water.
    #[getter]
    fn scratch(&self) -> u64 {
        self.inner.scratch
    }
    /// T4a: the activation pool (0 when the input measured none).
    #[getter]
    fn activations(&self) -> u64 {
        self.inner.activations
    }
    /// The full-attention KV pool as a dict (blocks, bytes, block_bytes, ...).
    #[getter]
    fn kv(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner.kv)
    }
    /// The KV host tier (T5b) as a dict (blocks, block_bytes, bytes), or
    /// None: pinned host memory, outside the device total.
    #[getter]
    fn kv_host(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner.kv_host)
    }
    /// The sliding-window KV pool as a dict, or None.
    #[getter]
    fn swa(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner.swa)
    }
    /// Other T3 pools (linear / SSM state), as dicts.
    #[getter]
    fn pools(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner.pools)
    }
    #[getter]
    fn kv_blocks(&self) -> u64 {
        self.inner.kv.blocks
    }
    #[getter]
    fn kv_bytes(&self) -> u64 {
        self.inner.kv.bytes
    }
    #[getter]
    fn library_reserve(&self) -> u64 {
        self.inner.library_reserve
    }
    #[getter]
    fn context(&self) -> u64 {
        self.inner.context
    }
    /// The measured warm-up line (`Features.warmup_bytes`); 0 without one.
    #[getter]
    fn warmup(&self) -> u64 {
        self.inner.warmup
    }
    /// `budget - total()`.
    #[getter]
    fn headroom(&self) -> u64 {
        self.inner.headroom
    }
    /// Every charge in report order, as `{"key", "label", "bytes"}` dicts.
    #[getter]
    fn charges(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_py_object(py, &self.inner.charges)
    }

    fn __str__(&self) -> String {
        self.inner.table()
    }

    fn __repr__(&self) -> String {
        format!(
            "MemoryPlan(total={}, budget={}, kv_blocks={}, headroom={})",
            imp_mem_core::units::human_bytes(self.inner.total),
            imp_mem_core::units::human_bytes(self.inner.budget),
            self.inner.kv.blocks,
            imp_mem_core::units::human_bytes(self.inner.headroom)
        )
    }
}

/// Plans memory for `plan_input`: a `MemoryPlan` within the budget, or
/// raises `PlanFailure` (the report is the message; `charges`, `total`,
/// `budget`, `over_by` and `levers` carry the arithmetic). Pure: no device
/// query.
#[pyfunction]
fn plan_memory(plan_input: &PyPlanInput) -> PyResult<PyMemoryPlan> {
    let plan = core::plan_memory(&plan_input.inner).py()?;
    Ok(PyMemoryPlan { inner: plan })
}

/// transformers' defaults of `model_type` (the fields a `config.json` may
/// leave out, key to value), as the planner reads them; empty for a type
/// the table does not cover.
#[pyfunction]
fn transformers_defaults(py: Python<'_>, model_type: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let model_type = convert::text(model_type, "model_type")?;
    to_py_object(py, &core::transformers_defaults(&model_type))
}

/// Parses a size such as `"80GiB"`, `"80 GB"` or `"81920MiB"` into bytes;
/// raises `InvalidArgument` naming `field` if it does not parse.
#[pyfunction]
#[pyo3(signature = (text, field = None), text_signature = "(text, field='size')")]
fn parse_size(text: &Bound<'_, PyAny>, field: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    let field = convert::opt(field, "field", convert::text)?;
    let field = field.as_deref().unwrap_or("size");
    core::parse_size(&convert::text(text, field)?, field).py()
}

/// Adds the planner's classes and functions to `imp_mem._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyModelShape>()?;
    m.add_class::<PyLimits>()?;
    m.add_class::<PyFeatures>()?;
    m.add_class::<PyPlanInput>()?;
    m.add_class::<PyMemoryPlan>()?;
    m.add_function(wrap_pyfunction!(plan_memory, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(transformers_defaults, m)?)?;
    m.add("H200_CONTEXT_BYTES", H200_CONTEXT_BYTES)?;
    m.add("H200_LIBRARY_RESERVE_BYTES", H200_LIBRARY_RESERVE_BYTES)?;
    Ok(())
}
