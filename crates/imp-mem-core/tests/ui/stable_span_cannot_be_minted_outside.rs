use imp_mem_core::span::{MintKey, StableSpan};
use imp_mem_core::Placement;

fn main() {
    let span = StableSpan::new(MintKey::new(), 0x1000, 64, Placement::HOST);
    println!("{}", span.addr());
}
