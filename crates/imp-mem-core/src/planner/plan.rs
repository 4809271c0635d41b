//! The arithmetic of `plan_memory` and the `MemoryPlan` it returns.
//!
//! Every charge is computed per rank, in bytes, and rounded up to a whole
//! MiB, so a plan's lines add up exactly to its total in the unit the report
//! prints. The order of allocation (seed A4.2) is the order of the charges:
//! context and library reserve are gone first, then T2, T1, the T3 pools;
//! the KV pool is sized last, from what remains, with the full
//! configuration's need as its target and never more (B1).

use serde::{Deserialize, Serialize};

use super::dtype::Dtype;
use super::failure::{Charge, FailureKind, Lever, PlanError, PlanFailure};
use super::input::{KvPolicy, PlanInput, MAX_BYTES};
use super::shape::Attention;
use crate::error::MemError;
use crate::units::MIB;

/// GEMM library workspaces held for the engine's life (T2), fixed.
pub const GEMM_WORKSPACE_BYTES: u64 = 32 * MIB;
/// Prefill chunk when `Limits::max_batch_tokens` is not given.
pub const DEFAULT_MAX_BATCH_TOKENS: u64 = 8192;

/// A paged KV pool: its geometry and its size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvPlan {
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes one token costs over this pool's layers, on this rank.
    pub bytes_per_token: u64,
    /// Bytes of one block over this pool's layers.
    pub block_bytes: u64,
    /// Blocks one full sequence needs.
    pub blocks_per_sequence: u64,
    /// Blocks of the full configuration (`max_batch` sequences).
    pub target_blocks: u64,
    /// Blocks planned.
    pub blocks: u64,
    /// Full sequences the planned blocks hold.
    pub full_sequences: u64,
    /// The sliding window for the SWA pool, `None` for the full-attention pool.
    pub window: Option<u64>,
    /// Bytes charged, a whole number of MiB.
    pub bytes: u64,
}

/// A fixed-slot T3 pool (SSM / linear-attention state, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolPlan {
    /// What the pool holds.
    pub name: String,
    /// Slots, one per sequence.
    pub slots: u64,
    /// Bytes of one slot on this rank.
    pub bytes_per_slot: u64,
    /// Bytes charged, a whole number of MiB.
    pub bytes: u64,
}

/// The KV host tier (T5b): pinned host blocks of the KV pool's block size,
/// within `Features::kv_host_bytes` (host memory, outside the device total).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostKvPlan {
    /// Host blocks.
    pub blocks: u64,
    /// Bytes of one block (the device KV pool's).
    pub block_bytes: u64,
    /// `blocks * block_bytes`.
    pub bytes: u64,
}

/// A successful plan: every tier's size on one rank, all within the budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// The budget planned against.
    pub budget: u64,
    /// Tensor-parallel degree; every figure is per rank.
    pub tp: u32,
    /// T1: weights, vision tower and draft model.
    pub model_resident: u64,
    /// Model weights (part of T1).
    pub weights: u64,
    /// Vision tower (part of T1).
    pub vision_tower: u64,
    /// Draft model (part of T1).
    pub draft_weights: u64,
    /// T2: workspaces, logits, block tables, LoRA slots.
    pub engine_persistent: u64,
    /// LoRA slots (part of T2).
    pub lora: u64,
    /// T4: forward-pass scratch high-water.
    pub scratch: u64,
    /// T4a: the activation pool (a framework's own allocations), from a
    /// measured high-water; 0 when the input measured none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub activations: u64,
    /// The paged KV pool of the full-attention layers (T3).
    pub kv: KvPlan,
    /// The sliding-window KV pool, its own id space (T3).
    pub swa: Option<KvPlan>,
    /// Other T3 pools.
    pub pools: Vec<PoolPlan>,
    /// Libraries' own reservation, measured (D7).
    pub library_reserve: u64,
    /// CUDA context and driver, measured (D7).
    pub context: u64,
    /// What a warm-up leaves outside the tiers (`Features::warmup_bytes`),
    /// measured; 0 when the input measured none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub warmup: u64,
    /// Sum of every charge.
    pub total: u64,
    /// `budget - total`: planned for nothing.
    pub headroom: u64,
    /// Every charge in report order; they add up to `total`.
    pub charges: Vec<Charge>,
    /// T5b, host side: the pinned host memory a level-1 sleep holds while
    /// T1 sleeps (a copy of T1, at most its size). Host memory, so outside
    /// `total` and the device budget.
    #[serde(default)]
    pub sleep_host: u64,
    /// The KV host tier, when `Features::kv_host_bytes` holds a block.
    #[serde(default)]
    pub kv_host: Option<HostKvPlan>,
}

impl MemoryPlan {
    /// Sum of every charge.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The plan as pretty JSON (deterministic: fields in declaration order).
    pub fn to_json(&self) -> Result<String, MemError> {
        super::to_json(self, "memory plan")
    }

    /// A plan read back from [`MemoryPlan::to_json`].
    pub fn from_json(text: &str) -> Result<MemoryPlan, MemError> {
        serde_json::from_str(text).map_err(|err| MemError::invalid(format!("plan JSON: {err}")))
    }

    /// The plan as a table, one charge a line, in MiB.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let width = super::failure::write_charges(&mut out, "charge", &self.charges);
        let _ = writeln!(out, "    {:<width$}{:>8}", "total", self.total / MIB);
        let _ = writeln!(out, "    {:<width$}{:>8}", "headroom", self.headroom / MIB);
        let _ = writeln!(
            out,
            "    budget {} MiB; KV {} blocks of {} tokens = {} full sequences",
            self.budget / MIB,
            self.kv.blocks,
            self.kv.block_size,
            self.kv.full_sequences
        );
        out
    }
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

pub(super) fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB).saturating_mul(MIB)
}

pub(super) fn floor_mib(bytes: u64) -> u64 {
    bytes / MIB * MIB
}

/// Everything the plan needs, computed once from the input.
struct Demand {
    weights: u64,
    vision: u64,
    draft: u64,
    workspaces: u64,
    lora: u64,
    scratch: u64,
    activations: u64,
    state_per_slot: u64,
    state: u64,
    kv_bytes_per_token: u64,
    kv_blocks_per_seq: u64,
    kv_target: u64,
    swa_bytes_per_token: u64,
    swa_blocks_per_seq: u64,
    swa_target: u64,
    context: u64,
    library: u64,
    warmup: u64,
}

impl Demand {
    fn kv_block_bytes(&self, block_size: u32) -> u64 {
        self.kv_bytes_per_token
            .saturating_mul(u64::from(block_size))
    }

    fn swa_block_bytes(&self, block_size: u32) -> u64 {
        self.swa_bytes_per_token
            .saturating_mul(u64::from(block_size))
    }

    /// Everything except the two KV pools.
    fn fixed(&self) -> u64 {
        [
            self.weights,
            self.vision,
            self.draft,
            self.workspaces,
            self.lora,
            self.scratch,
            self.activations,
            self.state,
            self.context,
            self.library,
            self.warmup,
        ]
        .iter()
        .fold(0u64, |acc, x| acc.saturating_add(*x))
    }
}

fn demand(input: &PlanInput) -> Result<Demand, MemError> {
    input.validate()?;
    let m = &input.model;
    let l = &input.limits;
    let f = &input.features;
    let tp = u64::from(input.tp);
    let act = m.dtype.bytes();
    let kv_dtype = input.kv_dtype();
    let bs = u64::from(l.block_size);
    let batch = u64::from(l.max_batch);

    // Inputs are bounded by validate() (dims <= 2^32, counts <= 2^34), so
    // u128 products cannot overflow; results are checked against MAX_BYTES.
    let w = |x: u128| -> u64 { u64::try_from(x).unwrap_or(u64::MAX) };

    let seq_tokens = l.max_seq_len.saturating_add(u64::from(f.spec_depth));
    let kv_blocks_per_seq = seq_tokens.div_ceil(bs);
    let per_token = m.kv_bytes_per_token(kv_dtype, input.tp);
    let (swa_bytes_per_token, swa_blocks_per_seq) = match m.sliding_window {
        Some(window) if m.sliding_layers > 0 => (
            per_token.sliding,
            kv_blocks_per_seq.min(window.div_ceil(bs).saturating_add(1)),
        ),
        _ => (0, 0),
    };

    let decode_tokens = batch.saturating_mul(1 + u64::from(f.spec_depth));
    let chunk = l
        .max_batch_tokens
        .unwrap_or_else(|| DEFAULT_MAX_BATCH_TOKENS.min(batch.saturating_mul(l.max_seq_len)));
    let forward_tokens = chunk.max(decode_tokens);
    let q_dim = m.q_dim().div_ceil(tp);
    let kv_dim = match m.attention {
        Attention::Gqa {
            num_kv_heads,
            head_dim,
            v_head_dim,
        } => num_kv_heads
            .div_ceil(tp)
            .saturating_mul(head_dim.saturating_add(v_head_dim)),
        Attention::Mla {
            kv_lora_rank,
            qk_rope_head_dim,
            ..
        } => kv_lora_rank.saturating_add(qk_rope_head_dim),
    };
    let ffn = match &m.moe {
        Some(moe) => m
            .intermediate_size
            .max(
                moe.experts_per_token
                    .saturating_mul(moe.expert_intermediate_size),
            )
            .max(moe.shared_intermediate_size),
        None => m.intermediate_size,
    }
    .div_ceil(tp);
    let hidden = u128::from(m.hidden_size);

    let scratch = match f.scratch_bytes {
        Some(bytes) => bytes,
        None => {
            let attn = q_dim.saturating_mul(2).saturating_add(kv_dim);
            let per_token = 2 * hidden + u128::from(attn.max(ffn.saturating_mul(2)));
            w(u128::from(forward_tokens) * per_token * u128::from(act))
        }
    };
    let workspaces = match f.engine_persistent_bytes {
        Some(bytes) => bytes,
        None => {
            let logits = u128::from(decode_tokens) * u128::from(m.vocab_size.div_ceil(tp)) * 4;
            let tables = u128::from(batch) * u128::from(kv_blocks_per_seq + swa_blocks_per_seq) * 4;
            let decode_acts = u128::from(decode_tokens) * hidden * u128::from(act) * 4;
            w(u128::from(GEMM_WORKSPACE_BYTES) + logits + tables + decode_acts)
        }
    };
    let lora = if f.lora_slots > 0 {
        let h = hidden;
        let q = u128::from(m.q_dim());
        let kv = u128::from(kv_dim) * tp as u128 / 2;
        let inter = u128::from(m.intermediate_size);
        let per_layer = (h + q) * 2 + (h + kv) * 2 + (h + inter) * 3;
        let per_slot = per_layer
            .saturating_mul(u128::from(f.lora_rank))
            .saturating_mul(u128::from(m.num_layers))
            .saturating_mul(u128::from(act));
        w(per_slot
            .saturating_mul(u128::from(f.lora_slots))
            .div_ceil(u128::from(tp)))
    } else {
        0
    };
    let state_per_slot =
        w(u128::from(m.state_layers) * u128::from(m.state_bytes_per_layer.div_ceil(tp)));
    let state = w(u128::from(state_per_slot) * u128::from(batch));

    let d = Demand {
        weights: m.rank_weights_line(input.tp),
        vision: mib(f.vision_tower_bytes.div_ceil(tp)),
        draft: mib(f.draft_weights_bytes.div_ceil(tp)),
        workspaces: mib(workspaces),
        lora: mib(lora),
        scratch: mib(scratch),
        activations: mib(f.activation_bytes.unwrap_or(0)),
        state_per_slot,
        state: mib(state),
        kv_bytes_per_token: per_token.full,
        kv_blocks_per_seq,
        kv_target: if per_token.full > 0 && l.kv_policy != KvPolicy::None {
            batch
                .saturating_mul(kv_blocks_per_seq)
                .saturating_add(f.engine_kv_blocks)
        } else {
            0
        },
        swa_bytes_per_token,
        swa_blocks_per_seq,
        swa_target: if swa_blocks_per_seq > 0 && l.kv_policy != KvPolicy::None {
            batch
                .saturating_mul(swa_blocks_per_seq)
                .saturating_add(f.engine_swa_blocks)
        } else {
            0
        },
        context: mib(input.context_bytes),
        library: mib(input.library_reserve_bytes),
        warmup: mib(f.warmup_bytes),
    };
    let kv_bytes = d.kv_block_bytes(l.block_size).saturating_mul(d.kv_target);
    let swa_bytes = d.swa_block_bytes(l.block_size).saturating_mul(d.swa_target);
    for (name, value) in [
        ("weights", d.weights),
        ("scratch", d.scratch),
        ("activations", d.activations),
        ("engine_persistent", d.workspaces),
        ("lora", d.lora),
        ("state", d.state),
        ("kv_pool", kv_bytes),
        ("swa_pool", swa_bytes),
    ] {
        if value > MAX_BYTES {
            return Err(MemError::invalid(format!(
                "the configuration asks for more than 256 PiB of {name}; check the limits and the model shape"
            )));
        }
    }
    Ok(d)
}

fn kv_label(input: &PlanInput, blocks: u64, target: u64, bs: u32) -> String {
    if input.limits.kv_policy == KvPolicy::None {
        "KV pool (none: the caller keeps its KV)".into()
    } else if blocks == target {
        let engine = match input.features.engine_kv_blocks {
            0 => String::new(),
            n => format!(" + {n} engine blocks"),
        };
        format!(
            "KV pool ({} x {} tok{engine}, {})",
            input.limits.max_batch,
            input.limits.max_seq_len,
            input.kv_dtype()
        )
    } else {
        format!(
            "KV pool ({} tok, {})",
            blocks.saturating_mul(u64::from(bs)),
            input.kv_dtype()
        )
    }
}

fn charges(input: &PlanInput, d: &Demand, kv_blocks: u64) -> Vec<Charge> {
    let bs = input.limits.block_size;
    let mut out = Vec::with_capacity(12);
    let mut push = |key: &str, label: String, bytes: u64| {
        if bytes > 0 || matches!(key, "weights" | "kv_pool" | "context" | "library_reserve") {
            out.push(Charge {
                key: key.to_string(),
                label,
                bytes,
            });
        }
    };
    push("weights", "model weights".to_string(), d.weights);
    push("vision_tower", "vision tower".to_string(), d.vision);
    push("draft_weights", "draft model".to_string(), d.draft);
    push(
        "kv_pool",
        kv_label(input, kv_blocks, d.kv_target, bs),
        mib(d.kv_block_bytes(bs) * kv_blocks),
    );
    if let Some(window) = input.model.sliding_window.filter(|_| d.swa_target > 0) {
        push(
            "swa_pool",
            format!("SWA KV pool (window {window} tok)"),
            mib(d.swa_block_bytes(bs) * d.swa_target),
        );
    }
    push(
        "state",
        format!("linear/SSM state ({} seqs)", input.limits.max_batch),
        d.state,
    );
    push(
        "scratch",
        "executor scratch (high-water)".to_string(),
        d.scratch,
    );
    push(
        "activations",
        "torch activations (measured high-water)".to_string(),
        d.activations,
    );
    push(
        "engine_persistent",
        "engine-persistent".to_string(),
        d.workspaces,
    );
    push(
        "lora",
        format!("LoRA slots ({})", input.features.lora_slots),
        d.lora,
    );
    push("context", "CUDA context + driver".to_string(), d.context);
    // Unqualified like the context: the report says whether the figure
    // was measured on the device or taken from the plan.
    push("library_reserve", "library reserve".to_string(), d.library);
    push(
        "warmup",
        "warm-up: graph pools, activations, kernel modules (measured)".to_string(),
        d.warmup,
    );
    out
}

fn sum(charges: &[Charge]) -> u64 {
    charges
        .iter()
        .fold(0u64, |acc, c| acc.saturating_add(c.bytes))
}

/// The requested total: every charge, the KV pools at their full target.
fn requested_total(input: &PlanInput) -> Result<u64, MemError> {
    let d = demand(input)?;
    Ok(sum(&charges(input, &d, d.kv_target)))
}

/// Plans without computing levers on failure.
pub(crate) fn try_plan(input: &PlanInput) -> Result<MemoryPlan, PlanError> {
    let d = demand(input)?;
    let bs = input.limits.block_size;
    let budget = input.budget;
    let kv_block_bytes = d.kv_block_bytes(bs);
    let swa_bytes = if d.swa_target > 0 {
        mib(d.swa_block_bytes(bs) * d.swa_target)
    } else {
        0
    };
    let requested = charges(input, &d, d.kv_target);
    let requested_total = sum(&requested);

    let fail = |kind: FailureKind| {
        PlanError::DoesNotFit(Box::new(PlanFailure {
            kind,
            budget,
            charges: requested.clone(),
            total: requested_total,
            over_by: requested_total.saturating_sub(budget),
            levers: Vec::new(),
            max_batch_fits: None,
        }))
    };

    let kv_blocks = if requested_total <= budget {
        d.kv_target
    } else {
        match input.limits.kv_policy {
            KvPolicy::Full | KvPolicy::None => return Err(fail(FailureKind::OverBudget)),
            KvPolicy::Fit => {
                let before_kv = d.fixed().saturating_add(swa_bytes);
                if before_kv >= budget || kv_block_bytes == 0 {
                    return Err(fail(FailureKind::OverBudget));
                }
                let fit = floor_mib(budget - before_kv) / kv_block_bytes;
                let blocks = fit.min(d.kv_target);
                if blocks < d.kv_blocks_per_seq {
                    return Err(fail(FailureKind::BelowAdmissionFloor {
                        kv_tokens: blocks.saturating_mul(u64::from(bs)),
                        sequence_tokens: d.kv_blocks_per_seq.saturating_mul(u64::from(bs)),
                    }));
                }
                blocks
            }
        }
    };

    let planned = charges(input, &d, kv_blocks);
    let total = sum(&planned);
    if total > budget {
        return Err(PlanError::Invalid(MemError::Invariant(format!(
            "plan total {total} exceeds budget {budget} after sizing"
        ))));
    }
    let kv_dtype = input.kv_dtype();
    let full_sequences = if d.kv_blocks_per_seq == 0 || kv_block_bytes == 0 {
        u64::from(input.limits.max_batch)
    } else {
        kv_blocks / d.kv_blocks_per_seq
    };
    let kv = KvPlan {
        dtype: kv_dtype,
        block_size: bs,
        bytes_per_token: d.kv_bytes_per_token,
        block_bytes: kv_block_bytes,
        blocks_per_sequence: d.kv_blocks_per_seq,
        target_blocks: d.kv_target,
        blocks: kv_blocks,
        full_sequences,
        window: None,
        bytes: mib(kv_block_bytes * kv_blocks),
    };
    let swa = (d.swa_target > 0).then(|| KvPlan {
        dtype: kv_dtype,
        block_size: bs,
        bytes_per_token: d.swa_bytes_per_token,
        block_bytes: d.swa_block_bytes(bs),
        blocks_per_sequence: d.swa_blocks_per_seq,
        target_blocks: d.swa_target,
        blocks: d.swa_target,
        full_sequences: u64::from(input.limits.max_batch),
        window: input.model.sliding_window,
        bytes: swa_bytes,
    });
    let pools = if d.state > 0 {
        vec![PoolPlan {
            name: "linear/SSM state".to_string(),
            slots: u64::from(input.limits.max_batch),
            bytes_per_slot: d.state_per_slot,
            bytes: d.state,
        }]
    } else {
        Vec::new()
    };
    let kv_host =
        (input.features.kv_host_bytes >= kv.block_bytes && kv.block_bytes > 0).then(|| {
            // At most u32::MAX blocks: a host tier's slots are u32 ids.
            let blocks = (input.features.kv_host_bytes / kv.block_bytes).min(u64::from(u32::MAX));
            HostKvPlan {
                blocks,
                block_bytes: kv.block_bytes,
                bytes: blocks * kv.block_bytes,
            }
        });
    Ok(MemoryPlan {
        kv_host,
        budget,
        tp: input.tp,
        model_resident: d.weights + d.vision + d.draft,
        weights: d.weights,
        vision_tower: d.vision,
        draft_weights: d.draft,
        engine_persistent: d.workspaces + d.lora,
        lora: d.lora,
        scratch: d.scratch,
        activations: d.activations,
        kv,
        swa,
        pools,
        library_reserve: d.library,
        context: d.context,
        warmup: d.warmup,
        total,
        headroom: budget - total,
        charges: planned,
        sleep_host: d.weights + d.vision + d.draft,
    })
}

/// Plans the memory of `input`: a [`MemoryPlan`] within the budget, or a
/// [`PlanFailure`] with the itemised arithmetic and the three largest
/// levers, or an invalid-input error naming the field. Pure and
/// deterministic: no device, no clock, no hash-map order.
pub fn plan_memory(input: &PlanInput) -> Result<MemoryPlan, PlanError> {
    match try_plan(input) {
        Err(PlanError::DoesNotFit(mut failure)) => {
            let best = largest_batch(input);
            failure.levers = levers(input, failure.total, best);
            failure.max_batch_fits = best.filter(|&b| try_plan(&with_batch(input, b)).is_ok());
            Err(PlanError::DoesNotFit(failure))
        }
        other => other,
    }
}

/// `input` at `max_batch` `b`.
fn with_batch(input: &PlanInput, b: u32) -> PlanInput {
    let mut changed = input.clone();
    changed.limits.max_batch = b;
    changed
}

/// The largest `max_batch` below the asked one whose requested total fits
/// the budget, or `None` when 1 does not (or the batch is already 1).
/// Totals grow with the batch, so a binary search finds it exactly.
fn largest_batch(input: &PlanInput) -> Option<u32> {
    let batch = input.limits.max_batch;
    let fits = |b: u32| requested_total(&with_batch(input, b)).is_ok_and(|t| t <= input.budget);
    if batch <= 1 || !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1u32, batch - 1);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

/// The levers of seed A4.3, each recomputed through the same arithmetic:
/// halve `max_seq_len`, KV to fp8, the largest `max_batch` that fits, the
/// fewest tensor-parallel ranks (doubling) that fit, else twice as many. The three that free the most, largest first.
/// `best_batch`: [`largest_batch`] of `input`, searched once by the caller.
fn levers(input: &PlanInput, total: u64, best_batch: Option<u32>) -> Vec<Lever> {
    let mut out: Vec<Lever> = Vec::new();
    let mut consider = |setting: &str, from: String, to: String, changed: PlanInput| {
        if let Ok(new_total) = requested_total(&changed) {
            let frees = total.saturating_sub(new_total);
            if frees > 0 {
                let sufficient = try_plan(&changed).is_ok();
                out.push(Lever {
                    setting: setting.to_string(),
                    from,
                    to,
                    frees,
                    sufficient,
                });
            }
        }
    };

    let seq = input.limits.max_seq_len;
    if seq >= 2 {
        let mut changed = input.clone();
        changed.limits.max_seq_len = seq / 2;
        consider(
            "max_seq_len",
            seq.to_string(),
            (seq / 2).to_string(),
            changed,
        );
    }
    let kv = input.kv_dtype();
    if kv.bytes() > Dtype::Fp8.bytes() {
        let mut changed = input.clone();
        changed.limits.kv_dtype = Some(Dtype::Fp8);
        consider("kv_dtype", kv.to_string(), Dtype::Fp8.to_string(), changed);
    }
    let batch = input.limits.max_batch;
    if batch > 1 {
        let best = best_batch.unwrap_or(1);
        consider(
            "max_batch",
            batch.to_string(),
            best.to_string(),
            with_batch(input, best),
        );
    }
    if let Some(tp2) = input.tp.checked_mul(2) {
        // The fewest ranks (doubling) that make the plan fit and split the
        // heads evenly; twice the ranks when no such degree up to 64 times
        // as many does (deepseek-v3 on one 80 GiB device needs more than 2).
        let with_tp = |tp: u32| {
            let mut changed = input.clone();
            changed.tp = tp;
            changed
        };
        let enough = (1..=6)
            .filter_map(|k| input.tp.checked_mul(1 << k))
            .filter(|&tp| tp <= 4096 && input.model.check_tp(tp).is_ok())
            .find(|&tp| try_plan(&with_tp(tp)).is_ok());
        let tp = enough.unwrap_or(tp2);
        consider("tp", input.tp.to_string(), tp.to_string(), with_tp(tp));
    }
    // Largest first; equal savings keep the order above (stable sort).
    out.sort_by_key(|lever| std::cmp::Reverse(lever.frees));
    out.truncate(3);
    out
}
