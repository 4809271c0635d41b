use imp_mem_core::{DeviceSpan, Placement, StableSpan};

fn main() {
    // SAFETY: the span is never used to reach memory.
    let device = unsafe { DeviceSpan::from_raw_parts(0x1000, 64, Placement::HOST) };
    let stable: StableSpan<'_> = device.into();
    println!("{}", stable.addr());
}
