//! [`Route`]: where a thread's mallocs go (the activation pool, or the T1
//! arena while it loads weights), set per thread as torch's MemPool scopes
//! are.

use std::cell::Cell;

/// Where the hooks' mallocs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The installed activation pool.
    Activations,
    /// The installed T1 arena (while loading weights).
    Weights,
}

impl Route {
    /// The route's name: `activations` or `weights`.
    pub const fn name(self) -> &'static str {
        match self {
            Route::Activations => "activations",
            Route::Weights => "weights",
        }
    }
}
thread_local! {
    /// This thread's route (torch's MemPool scopes are per thread too: a
    /// loading thread's route must not take another thread's forward into
    /// the bump arena).
    static ROUTE: Cell<u8> = const { Cell::new(0) };
}

/// Sets the calling thread's route.
pub fn set_route(route: Route) {
    let _ = ROUTE.try_with(|r| r.set(route as u8));
}

/// The calling thread's route (the activations while its locals are being
/// torn down).
pub fn route() -> Route {
    if ROUTE.try_with(Cell::get) == Ok(Route::Weights as u8) {
        Route::Weights
    } else {
        Route::Activations
    }
}
