use imp_mem_core::BlockPool;

fn main() {
    let pool = BlockPool::slots(4).unwrap();
    let block = pool.allocate().unwrap();
    let alias = block.clone();
    println!("{} {}", block.id(), alias.id());
}
