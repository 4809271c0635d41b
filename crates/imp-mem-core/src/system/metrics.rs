//! The report as Prometheus text exposition (format 0.0.4).

use std::fmt::Write as _;

use super::report::{BlockLine, MemReport, TagLine, TierLine};
use crate::tier::Tier;

impl MemReport {
    /// Prometheus text exposition (format 0.0.4) of this snapshot: base
    /// units, `_bytes` / `_total` suffixes, labels `tier` and `tag` only.
    pub fn metrics(&self) -> String {
        let mut m = Metrics::default();
        m.gauge(
            "imp_mem_budget_bytes",
            "The backend's budget cap.",
            &[(None, self.budget as f64)],
        );
        m.gauge(
            "imp_mem_capacity_bytes",
            "The device's capacity.",
            &[(None, self.capacity as f64)],
        );
        m.gauge(
            "imp_mem_plan_budget_bytes",
            "The budget the plan was made for.",
            &[(None, self.plan_budget as f64)],
        );
        m.gauge(
            "imp_mem_plan_total_bytes",
            "The plan's total over every charge.",
            &[(None, self.plan_total as f64)],
        );
        let device_tiers = [
            Tier::ModelResident,
            Tier::EnginePersistent,
            Tier::Pooled,
            Tier::Scratch,
            Tier::Activations,
        ];
        let per_tier = |f: &dyn Fn(&TierLine) -> u64| -> Vec<(Option<(&str, String)>, f64)> {
            device_tiers
                .iter()
                .map(|tier| {
                    let sum: u64 = self
                        .tiers
                        .iter()
                        .filter(|t| t.tier == tier.label())
                        .map(f)
                        .sum();
                    (Some(("tier", tier.name().to_ascii_lowercase())), sum as f64)
                })
                .collect()
        };
        m.gauge(
            "imp_mem_tier_planned_bytes",
            "Bytes the plan gives each tier.",
            &per_tier(&|t| t.planned),
        );
        m.gauge(
            "imp_mem_tier_reserved_bytes",
            "Address space each tier holds.",
            &per_tier(&|t| t.reserved),
        );
        m.gauge(
            "imp_mem_tier_committed_bytes",
            "Physical memory each tier holds.",
            &per_tier(&|t| t.committed),
        );
        m.gauge(
            "imp_mem_tier_live_bytes",
            "Bytes in use inside each tier (arena takes, live blocks, open scratch).",
            &per_tier(&|t| t.in_use),
        );
        m.gauge(
            "imp_mem_tier_high_water_bytes",
            "The most ever in use inside each tier.",
            &per_tier(&|t| t.high_water),
        );
        let per_tag = |f: &dyn Fn(&TagLine) -> u64| -> Vec<(Option<(&str, String)>, f64)> {
            self.tags
                .iter()
                .map(|t| (Some(("tag", t.tag.to_string())), f(t) as f64))
                .collect()
        };
        m.gauge(
            "imp_mem_reserved_bytes",
            "Address space reserved through the backend, per tag.",
            &per_tag(&|t| t.reserved),
        );
        m.gauge(
            "imp_mem_live_bytes",
            "Bytes held by live regions, per tag.",
            &per_tag(&|t| t.live),
        );
        m.gauge(
            "imp_mem_high_water_bytes",
            "The most bytes ever live, per tag.",
            &per_tag(&|t| t.peak),
        );
        m.counter(
            "imp_mem_acquisitions_total",
            "Acquisitions from the backend, per tag.",
            &per_tag(&|t| t.acquisitions),
        );
        m.counter(
            "imp_mem_releases_total",
            "Releases to the backend, per tag.",
            &per_tag(&|t| t.releases),
        );
        m.counter(
            "imp_mem_steady_state_allocations_total",
            "Acquisitions while SERVING, per tag (criterion 3: zero).",
            &per_tag(&|t| t.steady_state_allocations),
        );
        let pools: Vec<(&TierLine, &BlockLine)> = self
            .tiers
            .iter()
            .filter_map(|t| t.blocks.as_ref().map(|b| (t, b)))
            .collect();
        let per_pool = |f: &dyn Fn(&BlockLine) -> u64| -> Vec<(Option<(&str, String)>, f64)> {
            pools
                .iter()
                .map(|(t, b)| (Some(("tag", t.tag.to_string())), f(b) as f64))
                .collect()
        };
        if !pools.is_empty() {
            m.gauge(
                "imp_mem_pool_capacity_blocks",
                "Blocks that exist in each T3 pool now.",
                &per_pool(&|b| u64::from(b.capacity)),
            );
            m.gauge(
                "imp_mem_pool_max_blocks",
                "Blocks each T3 pool can grow to.",
                &per_pool(&|b| u64::from(b.max_blocks)),
            );
            m.gauge(
                "imp_mem_pool_free_blocks",
                "Blocks on each T3 pool's free list.",
                &per_pool(&|b| u64::from(b.free)),
            );
            m.gauge(
                "imp_mem_pool_live_blocks",
                "Blocks with at least one ref in each T3 pool.",
                &per_pool(&|b| u64::from(b.live)),
            );
            m.gauge(
                "imp_mem_pool_block_bytes",
                "Bytes per block of each T3 pool.",
                &per_pool(&|b| b.block_bytes),
            );
        }
        let charge = |key: &str| {
            self.charges
                .iter()
                .filter(|c| c.key == key)
                .map(|c| c.bytes)
                .sum::<u64>()
        };
        let named: u64 = self
            .charges
            .iter()
            .filter(|c| c.key != "context" && c.key != "library_reserve")
            .map(|c| c.bytes)
            .sum();
        m.gauge(
            "imp_mem_context_bytes",
            "The CUDA context and driver (measured, or the plan's figure).",
            &[(None, charge("context") as f64)],
        );
        m.gauge(
            "imp_mem_library_reserve_bytes",
            "The libraries' own reservation (measured, or the plan's figure).",
            &[(None, charge("library_reserve") as f64)],
        );
        m.gauge(
            "imp_mem_named_charges_bytes",
            "Other named charges outside the backend.",
            &[(None, named as f64)],
        );
        m.gauge(
            "imp_mem_asleep_committed_bytes",
            "Bytes the sleeping tiers committed before they slept, given back to the device.",
            &[(None, self.asleep_released as f64)],
        );
        m.gauge(
            "imp_mem_sleep_host_bytes",
            "Pinned host memory held for sleeping tiers (T5b).",
            &[(None, self.sleep_host as f64)],
        );
        m.gauge(
            "imp_mem_attributed_bytes",
            "Backend-committed bytes plus every named charge.",
            &[(None, self.attributed as f64)],
        );
        if let Some(d) = &self.device {
            m.gauge(
                "imp_mem_device_total_bytes",
                "Device memory in all.",
                &[(None, d.total as f64)],
            );
            m.gauge(
                "imp_mem_device_used_bytes",
                "Device memory in use (total - free).",
                &[(None, d.used as f64)],
            );
            m.gauge(
                "imp_mem_device_other_processes_bytes",
                "Device memory other processes hold.",
                &[(None, d.other_processes as f64)],
            );
            m.gauge(
                "imp_mem_unattributed_bytes",
                "Memory this process uses that no charge names.",
                &[(None, d.unattributed as f64)],
            );
            m.gauge(
                "imp_mem_attribution_ratio",
                "Attributed / memory this process uses (criterion 6: >= 0.95).",
                &[(None, d.attribution_pct / 100.0)],
            );
        }
        m.out
    }
}

#[derive(Default)]
struct Metrics {
    out: String,
}

impl Metrics {
    fn family(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        samples: &[(Option<(&str, String)>, f64)],
    ) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
        for (label, value) in samples {
            let value = if value.fract() == 0.0 && value.abs() < 9.0e15 {
                format!("{}", *value as i64)
            } else {
                format!("{value}")
            };
            match label {
                Some((key, v)) => {
                    let _ = writeln!(self.out, "{name}{{{key}=\"{v}\"}} {value}");
                }
                None => {
                    let _ = writeln!(self.out, "{name} {value}");
                }
            }
        }
    }

    fn gauge(&mut self, name: &str, help: &str, samples: &[(Option<(&str, String)>, f64)]) {
        self.family(name, "gauge", help, samples);
    }

    fn counter(&mut self, name: &str, help: &str, samples: &[(Option<(&str, String)>, f64)]) {
        self.family(name, "counter", help, samples);
    }
}
