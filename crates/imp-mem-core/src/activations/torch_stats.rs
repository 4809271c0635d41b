//! The activation pool's counters under `torch.cuda.memory_stats` key
//! names, so a caller that reads torch's dict (a profiler, a serving
//! framework's memory report) reads the pool's without a translation of
//! its own. Every key is an `all` pool: the pool has no small/large split.
//! A fallback region (memory taken outside the pool when it is full)
//! counts as a segment and as reserved bytes, as a second `cudaMalloc`
//! would in torch.

use super::pool::ActivationPool;

impl ActivationPool {
    /// The counters as `(torch key, value)` pairs, in torch's order.
    pub fn torch_memory_stats(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats();
        // A measured pool holds what it committed, not its reservation.
        let reserved = if s.measuring {
            self.committed()
        } else {
            s.capacity
        };
        vec![
            ("allocated_bytes.all.current", s.in_use),
            ("allocated_bytes.all.peak", s.in_use_peak),
            ("allocated_bytes.all.allocated", s.allocated_bytes_total),
            ("allocated_bytes.all.freed", s.freed_bytes_total),
            ("requested_bytes.all.current", s.requested),
            ("active_bytes.all.current", s.in_use),
            ("active_bytes.all.peak", s.in_use_peak),
            ("reserved_bytes.all.current", reserved + s.fallback_bytes),
            ("reserved_bytes.all.peak", s.reserved_peak),
            ("allocation.all.current", s.live),
            ("allocation.all.peak", s.live_peak),
            ("allocation.all.allocated", s.allocs_total),
            ("allocation.all.freed", s.frees_total),
            ("active.all.current", s.live),
            ("active.all.peak", s.live_peak),
            ("segment.all.current", 1 + s.fallback_live),
            ("inactive_split.all.current", s.free_blocks),
            ("inactive_split_bytes.all.current", s.free_bytes),
            ("num_ooms", s.ooms),
            ("num_alloc_retries", s.reclaims),
            ("num_device_alloc", 1 + s.fallbacks_total),
            (
                "num_device_free",
                s.fallbacks_total.saturating_sub(s.fallback_live),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use crate::activations::{ActivationConfig, ActivationPool, NoStreams};
    use crate::fake::{FakeBackend, FakeConfig};

    #[test]
    fn the_counters_follow_an_allocation_and_its_free() {
        let fb = FakeBackend::new(FakeConfig {
            capacity: 64 << 20,
            ..FakeConfig::default()
        })
        .unwrap();
        let pool =
            ActivationPool::new(&fb, &ActivationConfig::new(1 << 20), Arc::new(NoStreams)).unwrap();
        let stats = |pool: &ActivationPool| -> BTreeMap<&str, u64> {
            pool.torch_memory_stats().into_iter().collect()
        };
        let a = pool.allocate(1000, 0).unwrap();
        let s = stats(&pool);
        assert_eq!(s.len(), 22, "one value per key");
        assert_eq!(s["allocated_bytes.all.current"], 1024);
        assert_eq!(s["requested_bytes.all.current"], 1000);
        assert_eq!(s["allocation.all.current"], 1);
        assert_eq!(s["reserved_bytes.all.current"], 1 << 20);
        assert_eq!((s["segment.all.current"], s["num_device_alloc"]), (1, 1));
        pool.free(a, 0).unwrap();
        let s = stats(&pool);
        assert_eq!(s["allocated_bytes.all.current"], 0);
        assert_eq!(s["allocated_bytes.all.peak"], 1024);
        assert_eq!(s["allocated_bytes.all.freed"], 1024);
        assert_eq!(
            (s["allocation.all.allocated"], s["allocation.all.freed"]),
            (1, 1)
        );
        assert_eq!(s["num_device_free"], 0);
    }
}
