//! The one place where core errors become Python exceptions: `MemError`,
//! and the errors that carry one with more facts (`OpenError`, `SwapError`)
//! or instead of one (`PlanError`'s `PlanFailure`). The rest of the binding
//! calls `.py()` on a core `Result` ([`IntoPyResult`]).
//!
//! The exception classes are defined in Python (`imp_mem/errors.py`) so that
//! they can also derive from `MemoryError` / `ValueError`; Rust imports them.

use imp_mem_core::planner::{FailureKind, PlanError, PlanFailure as CorePlanFailure};
use imp_mem_core::system::{OpenError, SwapError, WakeError};
use imp_mem_core::MemError;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

pyo3::import_exception!(imp_mem.errors, ImpMemError);
pyo3::import_exception!(imp_mem.errors, OutOfMemory);
pyo3::import_exception!(imp_mem.errors, CapacityError);
pyo3::import_exception!(imp_mem.errors, PhaseViolation);
pyo3::import_exception!(imp_mem.errors, Asleep);
pyo3::import_exception!(imp_mem.errors, StaleSpan);
pyo3::import_exception!(imp_mem.errors, PlanFailure);
pyo3::import_exception!(imp_mem.errors, BackendUnavailable);
pyo3::import_exception!(imp_mem.errors, InvalidArgument);
pyo3::import_exception!(imp_mem.errors, DriverError);
pyo3::import_exception!(imp_mem.errors, ImpMemWarning);

/// A value attached to a raised exception as an attribute.
enum Attr {
    /// An `int`.
    Int(u64),
    /// A `str`.
    Text(String),
    /// A `bool`.
    Flag(bool),
    /// A `list` of `str`.
    Texts(Vec<String>),
    /// Plain data (dicts, lists) given as JSON text, read by `json.loads`.
    Json(String),
}

/// An exception's message and attributes, turned into Python objects only
/// when the exception is raised: after the method returned, so never while
/// the binding or the core holds a lock. (Building them here could run a
/// garbage collection, whose callbacks may call back into the object whose
/// lock is held.) `ImpMemError.__init__` sets the attributes.
struct Facts {
    message: String,
    attrs: Vec<(&'static str, Attr)>,
}

impl pyo3::PyErrArguments for Facts {
    fn arguments(self, py: Python<'_>) -> Py<PyAny> {
        let message = self.message.clone();
        let build = || -> PyResult<Py<PyAny>> {
            let facts = py.import("imp_mem.errors")?.getattr("_Facts")?.call0()?;
            for (name, value) in self.attrs {
                match value {
                    Attr::Int(n) => facts.set_item(name, n)?,
                    Attr::Text(t) => facts.set_item(name, t)?,
                    Attr::Flag(b) => facts.set_item(name, b)?,
                    Attr::Texts(t) => facts.set_item(name, t)?,
                    Attr::Json(text) => {
                        let value = py.import("json")?.call_method1("loads", (text,))?;
                        facts.set_item(name, value)?
                    }
                }
            }
            (self.message, facts).into_py_any(py)
        };
        // Without its attributes the exception still has its class and
        // message.
        build()
            .or_else(|_| (message,).into_py_any(py))
            .unwrap_or_else(|_| py.None())
    }
}

/// The class, message and attributes `err` raises as.
fn facts(err: MemError) -> (fn(Facts) -> PyErr, Facts) {
    let message = err.to_string();
    let mut attrs = Vec::new();
    let class: fn(Facts) -> PyErr = match err {
        MemError::OutOfMemory(report) => {
            attrs.push(("asked", Attr::Int(report.asked)));
            attrs.push(("live", Attr::Int(report.live)));
            attrs.push(("budget", Attr::Int(report.budget)));
            attrs.push(("capacity", Attr::Int(report.capacity)));
            attrs.push(("tag", Attr::Text(report.tag.name().to_string())));
            attrs.push(("device_refused", Attr::Flag(report.device_refused)));
            if let Some(headroom) = report.ledger_headroom {
                attrs.push(("ledger_headroom", Attr::Int(headroom)));
            }
            OutOfMemory::new_err
        }
        MemError::HostOutOfMemory { bytes, .. } => {
            attrs.push(("asked", Attr::Int(bytes)));
            attrs.push(("device_refused", Attr::Flag(false)));
            OutOfMemory::new_err
        }
        MemError::PhaseViolation { phase, .. } => {
            attrs.push(("phase", Attr::Text(phase.name().to_string())));
            PhaseViolation::new_err
        }
        MemError::InvalidArgument(_) => InvalidArgument::new_err,
        MemError::StaleSpan(_) => StaleSpan::new_err,
        MemError::Asleep(_) => Asleep::new_err,
        MemError::Capacity(_) => CapacityError::new_err,
        MemError::KvCapacity(report) => {
            attrs.push(("needed", Attr::Int(report.needed.into())));
            attrs.push(("free", Attr::Int(report.free.into())));
            attrs.push(("growable", Attr::Int(report.growable.into())));
            attrs.push(("evictable", Attr::Int(report.evictable.into())));
            attrs.push(("pinned", Attr::Int(report.pinned.into())));
            attrs.push(("pool", Attr::Text(report.pool.to_string())));
            CapacityError::new_err
        }
        MemError::BackendUnavailable(_) => BackendUnavailable::new_err,
        MemError::Driver(_) => DriverError::new_err,
        MemError::Invariant(_) => ImpMemError::new_err,
        MemError::LedgerFull(refusal) => {
            // A PlanFailure whose charges are the tenants' floors and the
            // new one's.
            let floors: u64 = refusal.tenants.iter().map(|t| t.2).sum();
            let total = floors.saturating_add(refusal.floor);
            let mut charges: Vec<serde_json::Value> = refusal
                .tenants
                .iter()
                .map(|(name, pid, floor, _)| {
                    serde_json::json!({
                        "key": format!("tenant:{name}"),
                        "label": format!("{name} (pid {pid}) floor"),
                        "bytes": floor,
                    })
                })
                .collect();
            charges.push(serde_json::json!({
                "key": format!("tenant:{}", refusal.name),
                "label": format!("{} floor (refused)", refusal.name),
                "bytes": refusal.floor,
            }));
            attrs.push(("kind", Attr::Text("ledger_full".to_string())));
            attrs.push(("total", Attr::Int(total)));
            attrs.push(("budget", Attr::Int(refusal.budget)));
            attrs.push(("over_by", Attr::Int(total.saturating_sub(refusal.budget))));
            attrs.push(("report", Attr::Text(message.clone())));
            attrs.push((
                "charges",
                Attr::Json(serde_json::Value::Array(charges).to_string()),
            ));
            attrs.push(("levers", Attr::Json("[]".to_string())));
            attrs.push(("max_batch_fits", Attr::Json("null".to_string())));
            PlanFailure::new_err
        }
    };
    (class, Facts { message, attrs })
}

/// Converts a core error into the matching Python exception, with the
/// arithmetic attached as attributes where there is some. Builds no Python
/// object (see [`Facts`]), so it is safe under any lock.
pub fn to_py(err: MemError) -> PyErr {
    let (class, facts) = facts(err);
    class(facts)
}

/// [`to_py`] with another message and more attributes.
fn to_py_with(err: MemError, message: String, more: Vec<(&'static str, Attr)>) -> PyErr {
    let (class, mut facts) = facts(err);
    facts.message = message;
    facts.attrs.extend(more);
    class(facts)
}

/// A failed open: the step's exception, with the step in the message and
/// as attributes (`step`, `step_name`).
pub fn open_error(err: OpenError) -> PyErr {
    let message = err.to_string();
    to_py_with(
        err.error,
        message,
        vec![
            ("step", Attr::Int(err.step as u64)),
            ("step_name", Attr::Text(err.what)),
        ],
    )
}

/// A failed model swap: the error's exception with `old_model_kept` and
/// `missing`.
pub fn swap_error(err: SwapError) -> PyErr {
    let message = err.to_string();
    to_py_with(
        err.error,
        message,
        vec![
            ("old_model_kept", Attr::Flag(err.old_model_kept)),
            ("missing", Attr::Texts(err.missing)),
        ],
    )
}

/// A failed or refused wake: the error's exception (`OutOfMemory` when the
/// device had no room) with `needed`, `device_free` (None where the backend
/// cannot read its device), `budget_free`, `woken` and `still_asleep`.
pub fn wake_error(err: WakeError) -> PyErr {
    let message = err.to_string();
    let device_free = match err.device_free {
        Some(free) => Attr::Int(free),
        None => Attr::Json("null".into()),
    };
    to_py_with(
        err.error,
        message,
        vec![
            ("needed", Attr::Int(err.needed)),
            ("device_free", device_free),
            ("budget_free", Attr::Int(err.budget_free)),
            ("woken", Attr::Texts(err.woken)),
            ("still_asleep", Attr::Texts(err.still_asleep)),
        ],
    )
}

/// A plan that does not fit raises `PlanFailure`: the report as its
/// message, the arithmetic as attributes (`kind`, `total`, `budget`,
/// `over_by`, `report`, `charges`, `levers`, `max_batch_fits`); a bad input is its
/// `MemError`'s exception.
pub fn plan_error(err: PlanError) -> PyErr {
    match err {
        PlanError::Invalid(err) => to_py(err),
        PlanError::DoesNotFit(failure) => plan_failure(&failure),
    }
}

fn plan_failure(failure: &CorePlanFailure) -> PyErr {
    let report = failure.report();
    let kind = match failure.kind {
        FailureKind::OverBudget => "over_budget",
        FailureKind::BelowAdmissionFloor { .. } => "below_admission_floor",
    };
    let mut attrs = vec![
        ("kind", Attr::Text(kind.to_string())),
        ("total", Attr::Int(failure.total)),
        ("budget", Attr::Int(failure.budget)),
        ("over_by", Attr::Int(failure.over_by)),
        ("report", Attr::Text(report.clone())),
    ];
    // The message carries the same numbers if one did not serialise.
    if let Ok(charges) = serde_json::to_string(&failure.charges) {
        attrs.push(("charges", Attr::Json(charges)));
    }
    if let Ok(levers) = serde_json::to_string(&failure.levers) {
        attrs.push(("levers", Attr::Json(levers)));
    }
    attrs.push((
        "max_batch_fits",
        match failure.max_batch_fits {
            Some(batch) => Attr::Int(u64::from(batch)),
            None => Attr::Json("null".to_string()),
        },
    ));
    PlanFailure::new_err(Facts {
        message: report.trim_end().to_string(),
        attrs,
    })
}

/// A core error that has one Python exception: what `.py()` maps.
pub trait ToPyErr {
    /// The exception.
    fn to_py_err(self) -> PyErr;
}

impl ToPyErr for MemError {
    fn to_py_err(self) -> PyErr {
        to_py(self)
    }
}

impl ToPyErr for OpenError {
    fn to_py_err(self) -> PyErr {
        open_error(self)
    }
}

impl ToPyErr for SwapError {
    fn to_py_err(self) -> PyErr {
        swap_error(self)
    }
}

impl ToPyErr for PlanError {
    fn to_py_err(self) -> PyErr {
        plan_error(self)
    }
}

/// `Result<T, E>` of the core → `PyResult<T>`.
pub trait IntoPyResult<T> {
    /// Maps the error with its [`ToPyErr`].
    fn py(self) -> PyResult<T>;
}

impl<T, E: ToPyErr> IntoPyResult<T> for Result<T, E> {
    fn py(self) -> PyResult<T> {
        self.map_err(ToPyErr::to_py_err)
    }
}

/// An `InvalidArgument` with `message`.
pub fn invalid(message: impl Into<String>) -> PyErr {
    InvalidArgument::new_err(message.into())
}
