use imp_mem_core::{Arena, FakeBackend, FakeConfig, Tier};

fn main() {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let span = {
        let arena = Arena::new(&fb, Tier::ModelResident, 4096, None).unwrap();
        arena.take(64, 8).unwrap()
    };
    println!("{}", span.addr());
}
