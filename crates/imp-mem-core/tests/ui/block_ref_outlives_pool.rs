use imp_mem_core::BlockPool;

fn main() {
    let block = {
        let pool = BlockPool::slots(4).unwrap();
        pool.allocate().unwrap()
    };
    println!("{}", block.id());
}
