use imp_mem_core::{Arena, FakeBackend, FakeConfig, Tier};

fn main() {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut arena = Arena::new(&fb, Tier::ModelResident, 4096, None).unwrap();
    let span = arena.take(64, 8).unwrap();
    arena.reset();
    println!("{}", span.addr());
}
