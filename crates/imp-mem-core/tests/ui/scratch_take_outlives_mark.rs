use imp_mem_core::{FakeBackend, FakeConfig, ScratchStack};

fn main() {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let stack = ScratchStack::new(&fb, 4096, None).unwrap();
    let span = {
        let mark = stack.mark().unwrap();
        mark.take(64, 8).unwrap()
    };
    println!("{}", span.addr());
}
