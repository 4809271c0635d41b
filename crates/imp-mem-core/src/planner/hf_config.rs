//! Reading a Hugging Face `config.json` into a [`ModelShape`]
//! ([`ModelShape::from_hf_config`], [`ModelShape::from_hf_config_path`]).
//!
//! Readers of configs: the text model is `text_config` when present
//! (multimodal configs), falling back to the top level for fields such as
//! `torch_dtype` and `quantization_config`. A missing required field, a value
//! of the wrong type or an unknown dtype is an [`MemError::InvalidArgument`]
//! naming the field.

use std::path::Path;

use serde_json::{Map, Value};

use super::dtype::{Dtype, WeightFormat};
use super::safetensors::safetensors_bytes_in_dir;
use super::shape::{Attention, ModelShape, Moe, WeightSpec};
use crate::error::MemError;

impl ModelShape {
    /// Reads a Hugging Face `config.json` already parsed to JSON.
    pub fn from_hf_config(config: &Value) -> Result<ModelShape, MemError> {
        let top = config.as_object().ok_or_else(|| {
            MemError::invalid("config.json: expected a JSON object at the top level")
        })?;
        let (primary, fallback) = match top.get("text_config") {
            Some(Value::Object(text)) => (text, Some(top)),
            _ => (top, None),
        };
        // transformers' defaults for the fields the file leaves out, by the
        // text model's type.
        let model_type = [Some(primary), fallback]
            .into_iter()
            .flatten()
            .find_map(|m| m.get("model_type").and_then(Value::as_str))
            .unwrap_or_default();
        let defaults = super::hf_defaults::transformers_defaults(model_type);
        parse(&Cfg {
            primary,
            fallback,
            defaults: &defaults,
        })
    }

    /// Reads a `config.json` file; if a safetensors index or safetensors
    /// files sit beside it, their real tensor sizes replace the estimate.
    pub fn from_hf_config_path(path: &Path) -> Result<ModelShape, MemError> {
        let (config_path, dir) = if path.is_dir() {
            (path.join("config.json"), path.to_path_buf())
        } else {
            (
                path.to_path_buf(),
                path.parent().map(Path::to_path_buf).unwrap_or_default(),
            )
        };
        let text = std::fs::read_to_string(&config_path).map_err(|err| {
            MemError::invalid(format!(
                "config: cannot read {}: {err}",
                config_path.display()
            ))
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|err| {
            MemError::invalid(format!(
                "config: {} is not valid JSON: {err}",
                config_path.display()
            ))
        })?;
        let shape = ModelShape::from_hf_config(&value)?;
        Ok(match safetensors_bytes_in_dir(&dir)? {
            Some(bytes) => shape.with_measured_weights(bytes),
            None => shape,
        })
    }
}

/// A config with an optional fallback level (`text_config` over the top).
struct Cfg<'a> {
    primary: &'a Map<String, Value>,
    fallback: Option<&'a Map<String, Value>>,
    /// transformers' default for a key neither level has (`hf_defaults`);
    /// a key present as `null` keeps its "none".
    defaults: &'a Map<String, Value>,
}

impl<'a> Cfg<'a> {
    fn raw(&self, key: &str) -> Option<&'a Value> {
        let found = self.primary.get(key).filter(|v| !v.is_null());
        found
            .or_else(|| {
                self.fallback
                    .and_then(|f| f.get(key))
                    .filter(|v| !v.is_null())
            })
            .or_else(|| {
                let absent = !self.primary.contains_key(key)
                    && !self.fallback.is_some_and(|f| f.contains_key(key));
                absent.then(|| self.defaults.get(key)).flatten()
            })
    }

    /// The first of `keys` present, as a non-negative integer.
    fn u64_opt(&self, keys: &[&str]) -> Result<Option<u64>, MemError> {
        for key in keys {
            if let Some(value) = self.raw(key) {
                return as_u64(value, key).map(Some);
            }
        }
        Ok(None)
    }

    fn u64_req(&self, keys: &[&str]) -> Result<u64, MemError> {
        let value = self.u64_opt(keys)?.ok_or_else(|| missing(keys))?;
        if value == 0 {
            return Err(MemError::invalid(format!(
                "config.json: field '{}' must be positive",
                keys[0]
            )));
        }
        Ok(value)
    }

    /// Like `u64_req` but with a default when absent; zero is still refused.
    fn u64_or(&self, keys: &[&str], default: u64) -> Result<u64, MemError> {
        match self.u64_opt(keys)? {
            Some(0) => Err(MemError::invalid(format!(
                "config.json: field '{}' must be positive",
                keys[0]
            ))),
            Some(v) => Ok(v),
            None => Ok(default),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&'a str>, MemError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(MemError::invalid(format!(
                "config.json: field '{key}' should be a string, found {other}"
            ))),
        }
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>, MemError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(MemError::invalid(format!(
                "config.json: field '{key}' should be true or false, found {other}"
            ))),
        }
    }

    fn has(&self, key: &str) -> bool {
        self.raw(key).is_some()
    }
}

fn prod(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |acc, x| acc.saturating_mul(*x))
}

fn sum(terms: &[u64]) -> u64 {
    terms.iter().fold(0u64, |acc, x| acc.saturating_add(*x))
}

fn missing(keys: &[&str]) -> MemError {
    let also = if keys.len() > 1 {
        format!(
            " (also looked for {})",
            keys[1..]
                .iter()
                .map(|k| format!("'{k}'"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    } else {
        String::new()
    };
    MemError::invalid(format!("config.json: missing field '{}'{also}", keys[0]))
}

fn as_u64(value: &Value, key: &str) -> Result<u64, MemError> {
    if let Some(v) = value.as_u64() {
        return Ok(v);
    }
    if let Some(f) = value.as_f64() {
        if f >= 0.0 && f.fract() == 0.0 && f < 9.0e15 {
            return Ok(f as u64);
        }
    }
    Err(MemError::invalid(format!(
        "config.json: field '{key}' should be a non-negative integer, found {value}"
    )))
}

fn to_u32(value: u64, key: &str) -> Result<u32, MemError> {
    u32::try_from(value).map_err(|_| {
        MemError::invalid(format!("config.json: field '{key}' = {value} is too large"))
    })
}

/// What a layer holds, for counting.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LayerKind {
    Full,
    Sliding,
    State,
    /// Attention and a state side by side in one layer (Falcon-H1).
    FullAndState,
    /// Neither KV nor state (an MLP-only layer of a hybrid pattern).
    Neither,
}

/// Per-sequence state of one linear layer, in elements, and its parameters.
struct StateGeometry {
    elems: u64,
    params: u64,
}

fn parse(cfg: &Cfg<'_>) -> Result<ModelShape, MemError> {
    let model_type = cfg.str_opt("model_type")?.unwrap_or("model").to_string();
    let num_layers_u64 =
        cfg.u64_req(&["num_hidden_layers", "n_layer", "num_layers", "n_layers"])?;
    let num_layers = to_u32(num_layers_u64, "num_hidden_layers")?;
    let hidden = cfg.u64_req(&["hidden_size", "d_model", "n_embd", "dim"])?;
    let heads = cfg.u64_req(&["num_attention_heads", "n_head", "n_heads"])?;
    let vocab = cfg.u64_req(&["vocab_size", "padded_vocab_size"])?;
    let intermediate = cfg.u64_or(
        &["intermediate_size", "ffn_hidden_size", "n_inner"],
        4 * hidden,
    )?;
    let dtype = match cfg.str_opt("torch_dtype")?.or(cfg.str_opt("dtype")?) {
        Some(text) => Dtype::parse(text, "config.json: field 'torch_dtype'")?,
        None => Dtype::Bf16,
    };
    let default_head_dim = hidden / heads;
    if default_head_dim == 0 && !cfg.has("head_dim") {
        return Err(MemError::invalid(
            "config.json: field 'head_dim' is missing and hidden_size / num_attention_heads is 0",
        ));
    }

    let attention = if cfg.has("kv_lora_rank") {
        let kv_lora_rank = cfg.u64_req(&["kv_lora_rank"])?;
        let qk_rope_head_dim = cfg.u64_req(&["qk_rope_head_dim"])?;
        let qk_nope_head_dim = cfg.u64_or(&["qk_nope_head_dim"], default_head_dim)?;
        let v_head_dim = cfg.u64_or(&["v_head_dim"], qk_nope_head_dim)?;
        let q_lora_rank = cfg.u64_opt(&["q_lora_rank"])?.filter(|r| *r > 0);
        Attention::Mla {
            kv_lora_rank,
            qk_rope_head_dim,
            qk_nope_head_dim,
            v_head_dim,
            q_lora_rank,
        }
    } else {
        let multi_query = cfg.bool_opt("multi_query")?.unwrap_or(false);
        let kv_default = if multi_query { 1 } else { heads };
        let num_kv_heads = cfg.u64_or(
            &["num_key_value_heads", "num_kv_heads", "n_head_kv"],
            kv_default,
        )?;
        let head_dim = cfg.u64_or(&["head_dim", "attention_head_dim"], default_head_dim)?;
        let v_head_dim = cfg.u64_or(&["v_head_dim"], head_dim)?;
        let head_dim_given = cfg.has("head_dim") || cfg.has("attention_head_dim");
        super::validate::check_heads(heads, num_kv_heads, hidden, head_dim_given)?;
        Attention::Gqa {
            num_kv_heads,
            head_dim,
            v_head_dim,
        }
    };

    // Sliding window: on unless `use_sliding_window` says false (Qwen2/3
    // configs carry a window they do not use).
    let window = match cfg.u64_opt(&["sliding_window"])? {
        Some(w) if w > 0 && cfg.bool_opt("use_sliding_window")? != Some(false) => Some(w),
        _ => None,
    };

    let kinds = layer_kinds(cfg, &model_type, num_layers, window)?;
    let count = |pred: &dyn Fn(LayerKind) -> bool| -> u32 {
        kinds.iter().filter(|k| pred(**k)).count() as u32
    };
    let full_attention_layers = count(&|k| matches!(k, LayerKind::Full | LayerKind::FullAndState));
    let sliding_layers = count(&|k| k == LayerKind::Sliding);
    let state_layers = count(&|k| matches!(k, LayerKind::State | LayerKind::FullAndState));
    if sliding_layers > 0 && window.is_none() {
        return Err(MemError::invalid(
            "config.json: 'layer_types' has sliding_attention layers but field 'sliding_window' is missing",
        ));
    }
    let state = if state_layers > 0 {
        Some(state_geometry(cfg, hidden)?.ok_or_else(|| {
            MemError::invalid(
                "config.json: the model has linear-attention / Mamba layers but no state geometry \
                 (fields 'linear_num_value_heads'... or 'mamba_d_state'...)",
            )
        })?)
    } else {
        None
    };
    let state_bytes_per_layer = state
        .as_ref()
        .map_or(0, |s| s.elems.saturating_mul(dtype.bytes()));

    // MoE.
    let num_experts = cfg
        .u64_opt(&[
            "num_experts",
            "num_local_experts",
            "n_routed_experts",
            "moe_num_experts",
        ])?
        .unwrap_or(0);
    let moe = if num_experts > 1 {
        let experts_per_token = cfg.u64_or(
            &[
                "num_experts_per_tok",
                "num_experts_per_token",
                "moe_top_k",
                "top_k",
            ],
            1,
        )?;
        let expert_intermediate_size = cfg.u64_or(
            &["moe_intermediate_size", "expert_intermediate_size"],
            intermediate,
        )?;
        let shared_intermediate_size = match cfg.u64_opt(&["shared_expert_intermediate_size"])? {
            Some(size) => size,
            None => cfg
                .u64_opt(&["n_shared_experts", "num_shared_experts"])?
                .unwrap_or(0)
                .saturating_mul(expert_intermediate_size),
        };
        let moe_layers = moe_layer_count(cfg, num_layers, &kinds)?;
        Some(Moe {
            num_experts,
            experts_per_token,
            expert_intermediate_size,
            shared_intermediate_size,
            moe_layers,
        })
    } else {
        None
    };

    // Parameters, counted from the shape.
    let tie = cfg.bool_opt("tie_word_embeddings")?.unwrap_or(false);
    let embedding_params = vocab
        .saturating_mul(hidden)
        .saturating_mul(if tie { 1 } else { 2 });
    let attn_params = match attention {
        Attention::Gqa {
            num_kv_heads,
            head_dim,
            v_head_dim,
        } => sum(&[
            prod(&[hidden, heads, head_dim]),
            prod(&[hidden, num_kv_heads, head_dim.saturating_add(v_head_dim)]),
            prod(&[heads, v_head_dim, hidden]),
        ]),
        Attention::Mla {
            kv_lora_rank,
            qk_rope_head_dim,
            qk_nope_head_dim,
            v_head_dim,
            q_lora_rank,
        } => {
            let qk = qk_nope_head_dim.saturating_add(qk_rope_head_dim);
            let q = match q_lora_rank {
                Some(r) => prod(&[hidden, r]).saturating_add(prod(&[r, heads, qk])),
                None => prod(&[hidden, heads, qk]),
            };
            sum(&[
                q,
                prod(&[hidden, kv_lora_rank.saturating_add(qk_rope_head_dim)]),
                prod(&[
                    kv_lora_rank,
                    heads,
                    qk_nope_head_dim.saturating_add(v_head_dim),
                ]),
                prod(&[heads, v_head_dim, hidden]),
            ])
        }
    };
    let attention_layers = u64::from(full_attention_layers) + u64::from(sliding_layers);
    let mlp_layers = kinds.iter().filter(|k| **k != LayerKind::Neither).count() as u64;
    let (dense_mlp_layers, expert_params, moe_dense_params) = match &moe {
        Some(m) => {
            let moe_layers = u64::from(m.moe_layers);
            let experts = prod(&[
                moe_layers,
                m.num_experts,
                3,
                hidden,
                m.expert_intermediate_size,
            ]);
            let shared_and_router = prod(&[
                moe_layers,
                sum(&[
                    prod(&[3, hidden, m.shared_intermediate_size]),
                    prod(&[hidden, m.num_experts]),
                ]),
            ]);
            (
                mlp_layers.saturating_sub(moe_layers),
                experts,
                shared_and_router,
            )
        }
        None => (mlp_layers, 0, 0),
    };
    let dense_params = sum(&[
        prod(&[attention_layers, attn_params]),
        prod(&[
            u64::from(state_layers),
            state.as_ref().map_or(0, |s| s.params),
        ]),
        prod(&[dense_mlp_layers, 3, hidden, intermediate]),
        moe_dense_params,
    ]);

    let act_format = WeightFormat::from_dtype(dtype);
    let (dense_format, expert_format) = quantization(cfg, act_format)?;
    Ok(ModelShape {
        name: model_type,
        num_layers,
        hidden_size: hidden,
        vocab_size: vocab,
        num_attention_heads: heads,
        intermediate_size: intermediate,
        attention,
        full_attention_layers,
        sliding_layers,
        sliding_window: if sliding_layers > 0 { window } else { None },
        state_layers,
        state_bytes_per_layer,
        moe,
        dtype,
        weights: WeightSpec {
            embedding_params,
            dense_params,
            expert_params,
            embedding_format: act_format,
            dense_format,
            expert_format,
            measured_bytes: None,
        },
        max_position_embeddings: cfg.u64_opt(&[
            "max_position_embeddings",
            "n_positions",
            "max_seq_len",
        ])?,
    })
}

fn layer_kinds(
    cfg: &Cfg<'_>,
    model_type: &str,
    layers: u32,
    window: Option<u64>,
) -> Result<Vec<LayerKind>, MemError> {
    let n = layers as usize;
    if let Some(types) = cfg.raw("layer_types") {
        let list = types.as_array().ok_or_else(|| {
            MemError::invalid("config.json: field 'layer_types' should be a list of strings")
        })?;
        if list.len() != n {
            return Err(MemError::invalid(format!(
                "config.json: field 'layer_types' has {} entries but num_hidden_layers is {n}",
                list.len()
            )));
        }
        return list
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention" | "attention" | "global" | "global_attention" | "full") => {
                    Ok(LayerKind::Full)
                }
                Some(
                    "sliding_attention" | "sliding" | "local" | "local_attention"
                    | "sliding_window",
                ) => Ok(LayerKind::Sliding),
                Some("linear_attention" | "mamba" | "mamba2" | "ssm" | "linear") => {
                    Ok(LayerKind::State)
                }
                _ => Err(MemError::invalid(format!(
                    "config.json: field 'layer_types' has an unknown layer type {t}; expected \
                     full_attention, sliding_attention, linear_attention or mamba"
                ))),
            })
            .collect();
    }
    if let Some(pattern) = cfg.str_opt("hybrid_override_pattern")? {
        // Nemotron-H: M = Mamba, * = attention, - / E = MLP or MoE only.
        if pattern.chars().count() != n {
            return Err(MemError::invalid(format!(
                "config.json: field 'hybrid_override_pattern' has {} layers but num_hidden_layers is {n}",
                pattern.chars().count()
            )));
        }
        return Ok(pattern
            .chars()
            .map(|c| match c {
                'M' => LayerKind::State,
                '*' => LayerKind::Full,
                _ => LayerKind::Neither,
            })
            .collect());
    }
    if let Some(interval) = cfg.u64_opt(&["full_attention_interval"])? {
        // Qwen3-Next: every `interval`-th layer is full attention, the rest
        // Gated DeltaNet.
        let interval = interval.max(1);
        return Ok((0..n as u64)
            .map(|i| {
                if (i + 1) % interval == 0 {
                    LayerKind::Full
                } else {
                    LayerKind::State
                }
            })
            .collect());
    }
    if let Some(period) = cfg.u64_opt(&["attn_layer_period"])? {
        // Jamba: attention at `i % period == offset`, Mamba elsewhere.
        let period = period.max(1);
        let offset = cfg.u64_opt(&["attn_layer_offset"])?.unwrap_or(0);
        return Ok((0..n as u64)
            .map(|i| {
                if i % period == offset {
                    LayerKind::Full
                } else {
                    LayerKind::State
                }
            })
            .collect());
    }
    if let Some(indices) = cfg.raw("attn_layer_indices") {
        let list = indices.as_array().ok_or_else(|| {
            MemError::invalid(
                "config.json: field 'attn_layer_indices' should be a list of integers",
            )
        })?;
        let mut kinds = vec![LayerKind::State; n];
        for idx in list {
            let i = as_u64(idx, "attn_layer_indices")? as usize;
            let slot = kinds.get_mut(i).ok_or_else(|| {
                MemError::invalid(format!(
                    "config.json: field 'attn_layer_indices' names layer {i} of {n}"
                ))
            })?;
            *slot = LayerKind::Full;
        }
        return Ok(kinds);
    }
    if model_type == "falcon_h1" || cfg.has("mamba_d_ssm") {
        // Falcon-H1: attention and Mamba-2 side by side in every layer.
        return Ok(vec![LayerKind::FullAndState; n]);
    }
    let Some(_window) = window else {
        return Ok(vec![LayerKind::Full; n]);
    };
    let pattern = match cfg.u64_opt(&["sliding_window_pattern"])? {
        Some(p) => Some(p.max(1)),
        None if model_type.starts_with("gemma3") => Some(6),
        None if model_type == "cohere2" => Some(4),
        None => None,
    };
    if let Some(p) = pattern {
        // Gemma-3 / Cohere2: every p-th layer is global.
        return Ok((0..n as u64)
            .map(|i| {
                if (i + 1) % p == 0 {
                    LayerKind::Full
                } else {
                    LayerKind::Sliding
                }
            })
            .collect());
    }
    if model_type == "gemma2" {
        // Gemma-2: even layers slide, odd layers are global.
        return Ok((0..n)
            .map(|i| {
                if i % 2 == 0 {
                    LayerKind::Sliding
                } else {
                    LayerKind::Full
                }
            })
            .collect());
    }
    if let Some(max_window_layers) = cfg.u64_opt(&["max_window_layers"])? {
        // Qwen2 with use_sliding_window: layers from max_window_layers up slide.
        return Ok((0..n as u64)
            .map(|i| {
                if i >= max_window_layers {
                    LayerKind::Sliding
                } else {
                    LayerKind::Full
                }
            })
            .collect());
    }
    // Mistral-7B-v0.1: every layer slides.
    Ok(vec![LayerKind::Sliding; n])
}

fn state_geometry(cfg: &Cfg<'_>, hidden: u64) -> Result<Option<StateGeometry>, MemError> {
    if let Some(nv) = cfg.u64_opt(&["linear_num_value_heads"])? {
        // Gated DeltaNet (Qwen3-Next): a causal-conv window over q, k, v and
        // a dk x dv recurrent matrix per value head.
        let nk = cfg.u64_req(&["linear_num_key_heads"])?;
        let dk = cfg.u64_req(&["linear_key_head_dim"])?;
        let dv = cfg.u64_req(&["linear_value_head_dim"])?;
        let kernel = cfg.u64_or(&["linear_conv_kernel_dim"], 4)?;
        let conv_channels = sum(&[prod(&[2, nk, dk]), prod(&[nv, dv])]);
        let elems = sum(&[prod(&[kernel - 1, conv_channels]), prod(&[nv, dk, dv])]);
        let in_proj = sum(&[prod(&[2, nk, dk]), prod(&[2, nv, dv]), prod(&[2, nv])]);
        let params = sum(&[prod(&[hidden, in_proj]), prod(&[nv, dv, hidden])]);
        return Ok(Some(StateGeometry { elems, params }));
    }
    let d_state = cfg.u64_opt(&["mamba_d_state", "ssm_state_size", "state_size", "d_state"])?;
    let Some(d_state) = d_state else {
        return Ok(None);
    };
    let d_conv = cfg.u64_or(
        &["mamba_d_conv", "conv_kernel", "d_conv", "mamba_conv_kernel"],
        4,
    )?;
    let expand = cfg.u64_or(&["mamba_expand", "expand"], 2)?;
    let n_heads = cfg.u64_opt(&["mamba_n_heads", "mamba_num_heads"])?;
    let d_head = cfg.u64_opt(&["mamba_d_head", "mamba_head_dim"])?;
    let d_inner = match (cfg.u64_opt(&["mamba_d_ssm"])?, n_heads, d_head) {
        (Some(d), _, _) => d,
        (None, Some(h), Some(d)) => prod(&[h, d]),
        _ => prod(&[expand, hidden]),
    };
    let (conv_channels, in_proj_out) = if n_heads.is_some() || d_head.is_some() {
        // Mamba-2: B and C per group enter the conv too.
        let groups = cfg.u64_or(&["mamba_n_groups", "n_groups"], 1)?;
        let heads = n_heads.unwrap_or(d_inner / d_head.unwrap_or(64).max(1));
        let bc = prod(&[2, groups, d_state]);
        (sum(&[d_inner, bc]), sum(&[prod(&[2, d_inner]), bc, heads]))
    } else {
        // Mamba-1 (Jamba).
        (d_inner, prod(&[2, d_inner]))
    };
    let elems = sum(&[
        prod(&[d_conv - 1, conv_channels]),
        prod(&[d_inner, d_state]),
    ]);
    let params = sum(&[prod(&[hidden, in_proj_out]), prod(&[d_inner, hidden])]);
    Ok(Some(StateGeometry { elems, params }))
}

fn moe_layer_count(cfg: &Cfg<'_>, layers: u32, kinds: &[LayerKind]) -> Result<u32, MemError> {
    let n = u64::from(layers);
    if let Some(period) = cfg.u64_opt(&["expert_layer_period"])? {
        let period = period.max(1);
        let offset = cfg.u64_opt(&["expert_layer_offset"])?.unwrap_or(0);
        return Ok((0..n).filter(|i| i % period == offset).count() as u32);
    }
    if cfg.has("first_k_dense_replace") || cfg.has("moe_layer_freq") {
        // DeepSeek: the first k layers are dense.
        let k = cfg.u64_opt(&["first_k_dense_replace"])?.unwrap_or(0);
        let freq = cfg.u64_opt(&["moe_layer_freq"])?.unwrap_or(1).max(1);
        return Ok((0..n).filter(|i| *i >= k && i % freq == 0).count() as u32);
    }
    let step = cfg.u64_opt(&["decoder_sparse_step"])?.unwrap_or(1).max(1);
    let mut dense_only = Vec::new();
    if let Some(list) = cfg.raw("mlp_only_layers").and_then(Value::as_array) {
        for v in list {
            dense_only.push(as_u64(v, "mlp_only_layers")?);
        }
    }
    let mlp_layers = kinds.iter().filter(|k| **k != LayerKind::Neither).count() as u64;
    Ok((0..mlp_layers.min(n))
        .filter(|i| (i + 1) % step == 0 && !dense_only.contains(i))
        .count() as u32)
}

/// `(dense, expert)` weight formats from `quantization_config`.
fn quantization(
    cfg: &Cfg<'_>,
    act: WeightFormat,
) -> Result<(WeightFormat, WeightFormat), MemError> {
    let Some(q) = cfg.raw("quantization_config") else {
        return Ok((act, act));
    };
    let field = "config.json: field 'quantization_config.quant_method'";
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .ok_or_else(|| MemError::invalid(format!("{field} is missing")))?
        .to_ascii_lowercase();
    let bits = q.get("bits").and_then(Value::as_u64);
    let both = |f: WeightFormat| Ok((f, f));
    match method.as_str() {
        "fp8" | "fbgemm_fp8" | "fp8_e4m3" => both(WeightFormat::Fp8),
        // gpt-oss: only the routed experts are MXFP4.
        "mxfp4" => Ok((act, WeightFormat::Mxfp4)),
        "nvfp4" => both(WeightFormat::Nvfp4),
        "gptq" | "awq" | "gptq_marlin" | "awq_marlin" | "marlin" => match bits.unwrap_or(4) {
            8 => both(WeightFormat::Int8),
            2..=4 => both(WeightFormat::Int4),
            other => Err(MemError::invalid(format!(
                "config.json: field 'quantization_config.bits' = {other} is not supported (4 or 8)"
            ))),
        },
        "bitsandbytes" => {
            let four = q.get("load_in_4bit").and_then(Value::as_bool).unwrap_or(false);
            both(if four { WeightFormat::Nf4 } else { WeightFormat::Int8 })
        }
        "modelopt" => {
            let algo = q.get("quant_algo").and_then(Value::as_str).unwrap_or("").to_ascii_lowercase();
            match algo.as_str() {
                "nvfp4" => both(WeightFormat::Nvfp4),
                "fp8" => both(WeightFormat::Fp8),
                other => Err(MemError::invalid(format!(
                    "config.json: field 'quantization_config.quant_algo' = '{other}' is not supported (NVFP4, FP8)"
                ))),
            }
        }
        "compressed-tensors" | "compressed_tensors" => {
            // The first config group (JSON objects are ordered by key here).
            let weights = q
                .get("config_groups")
                .and_then(Value::as_object)
                .and_then(|groups| groups.values().next())
                .and_then(|g| g.get("weights"));
            let num_bits = weights.and_then(|w| w.get("num_bits")).and_then(Value::as_u64);
            let is_float = weights.and_then(|w| w.get("type")).and_then(Value::as_str) == Some("float");
            match (num_bits, is_float) {
                (Some(8), true) => both(WeightFormat::Fp8),
                (Some(8), false) => both(WeightFormat::Int8),
                (Some(4), true) => both(WeightFormat::Nvfp4),
                (Some(4), false) => both(WeightFormat::Int4),
                _ => Err(MemError::invalid(
                    "config.json: field 'quantization_config.config_groups.*.weights.num_bits' is missing or not 4/8",
                )),
            }
        }
        other => Err(MemError::invalid(format!(
            "{field} = '{other}' is not a known quantization (fp8, mxfp4, nvfp4, gptq, awq, bitsandbytes, \
             modelopt, compressed-tensors)"
        ))),
    }
}
