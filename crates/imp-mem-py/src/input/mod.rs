//! The token input layer (being assembled: the readers moved here first).

pub mod buffer;
pub mod ndarray;
pub mod sequence;
