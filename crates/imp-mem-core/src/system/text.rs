//! The report rendered as a text table in MiB (seed A4.3) and as JSON.

use std::fmt::Write as _;

use super::report::MemReport;
use super::ATTRIBUTION_TARGET;
use crate::error::MemError;
use crate::units::MIB;

const COMMITTED_LABEL: &str = "backend committed (every region, by tag)";

fn mib1(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB as f64)
}

impl MemReport {
    /// The report as a text table in MiB, in the style of seed A4.3.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "imp-mem memory report: {} backend, device {}, phase {}{}",
            self.backend,
            self.device_ordinal,
            self.phase,
            if self.closed { " (closed)" } else { "" }
        );
        let rounding = if self.granule_rounding > 0 {
            format!(
                " + {} MiB of growable tiers rounded up to whole granules",
                mib1(self.granule_rounding)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "budget {} MiB for the tiers (plan: {} MiB budget, {} MiB total{}, {} MiB headroom)",
            mib1(self.budget),
            mib1(self.plan_budget),
            mib1(self.plan_total),
            rounding,
            mib1(self.plan_headroom)
        );
        for m in &self.measured {
            let _ = writeln!(
                out,
                "measured tier {}: {}, high-water {} MiB, margin {} MiB, size {} MiB, committed \
                 {} MiB ({} MiB decommitted by the freeze)",
                m.tier,
                m.state,
                mib1(m.high_water),
                mib1(m.margin),
                mib1(m.size),
                mib1(m.committed),
                mib1(m.decommitted)
            );
        }
        if let Some(p) = &self.pass_plan {
            let _ = if p.installed {
                writeln!(
                    out,
                    "planned pass (activations): {} allocations laid out to {} MiB over a live \
                     peak of {} MiB (placed as they came: {} MiB); hints taken {}, missed {}, \
                     refused {} ({} a pass)",
                    p.allocations,
                    mib1(p.top),
                    mib1(p.live_peak),
                    mib1(p.recorded_high_water),
                    p.hits,
                    p.misses,
                    p.refused,
                    p.hints
                )
            } else {
                writeln!(
                    out,
                    "planned pass (activations): not followed: the layout's {} MiB is not under \
                     the {} MiB the pass reached placed as it came",
                    mib1(p.top),
                    mib1(p.recorded_high_water)
                )
            };
        }
        if !self.asleep.is_empty() {
            let _ = writeln!(
                out,
                "asleep: {} ({} MiB given back); T5b pinned host copy {} MiB (plan: {} MiB)",
                self.asleep.join(", "),
                mib1(self.asleep_released),
                mib1(self.sleep_host),
                mib1(self.sleep_host_planned)
            );
            let total: u64 = self.asleep_stays.iter().map(|s| s.bytes).sum();
            let _ = writeln!(out, "stays on the device while asleep: {} MiB", mib1(total));
            let w = self.asleep_stays.iter().map(|s| s.label.len()).max();
            for s in &self.asleep_stays {
                let _ = writeln!(
                    out,
                    "    {:<w$} {:>10}",
                    s.label,
                    mib1(s.bytes),
                    w = w.unwrap_or(0)
                );
            }
        } else if self.sleep_host > 0 {
            let _ = writeln!(
                out,
                "T5b pinned host memory held for the next sleep: {} MiB (plan: {} MiB)",
                mib1(self.sleep_host),
                mib1(self.sleep_host_planned)
            );
        }
        let _ = writeln!(out);
        let w = self
            .tiers
            .iter()
            .map(|t| t.label.len())
            .chain(self.charges.iter().map(|c| c.label.len() + 11))
            .max()
            .unwrap_or(0)
            .max(COMMITTED_LABEL.len() + 2);
        let _ = writeln!(
            out,
            "  {:<w$} {:<4} {:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "tier", "", "tag", "planned", "reserved", "committed", "in use", "high-water"
        );
        for t in &self.tiers {
            let _ = writeln!(
                out,
                "    {:<w2$} {:<4} {:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                t.label,
                t.tier,
                t.tag,
                mib1(t.planned),
                mib1(t.reserved),
                mib1(t.committed),
                mib1(t.in_use),
                mib1(t.high_water),
                w2 = w - 2
            );
            if let Some(b) = &t.blocks {
                let _ = writeln!(
                    out,
                    "      blocks: {} live, {} free, {} of at most {} ({} B each), high-water {}",
                    b.live, b.free, b.capacity, b.max_blocks, b.block_bytes, b.high_water
                );
            }
        }
        let roomy: Vec<&str> = self
            .tiers
            .iter()
            .filter(|t| t.reserved > t.planned)
            .map(|t| t.tier)
            .collect();
        if !roomy.is_empty() {
            let _ = writeln!(
                out,
                "    ({} reserves more than planned: reserved is address space, sized for the \
                 largest model a swap could bring, so it may add up past the budget; only \
                 committed bytes take device memory)",
                roomy.join(", ")
            );
        }
        for o in &self.outside {
            let _ = writeln!(
                out,
                "    {:<w2$} {:<4} {:<10} {:>10} {:>10} {:>10}",
                "outside the tiers",
                "-",
                o.tag,
                "-",
                "-",
                mib1(o.committed),
                w2 = w - 2
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "  {:<w$} {:>10} {:>10}", "charge", "planned", "MiB");
        for c in &self.charges {
            let how = if c.measured { "measured" } else { "plan" };
            let label = format!("{} ({how})", c.label);
            let _ = writeln!(
                out,
                "    {:<w2$} {:>10} {:>10}",
                label,
                c.planned.map_or_else(|| "-".to_string(), mib1),
                mib1(c.bytes),
                w2 = w - 2
            );
        }
        let _ = writeln!(
            out,
            "    {:<w2$} {:>10} {:>10}",
            "",
            "",
            "-----",
            w2 = w - 2
        );
        let _ = writeln!(
            out,
            "    {:<w2$} {:>10} {:>10}",
            COMMITTED_LABEL,
            "",
            mib1(self.backend_committed),
            w2 = w - 2
        );
        let _ = writeln!(
            out,
            "    {:<w2$} {:>10} {:>10}",
            "attributed",
            "",
            mib1(self.attributed),
            w2 = w - 2
        );
        if self.planned_unclaimed > 0 {
            let _ = writeln!(
                out,
                "    {:<w2$} {:>10} {:>10}",
                "planned, not claimed (estimate)",
                mib1(self.planned_unclaimed),
                "",
                w2 = w - 2
            );
        }
        match &self.device {
            Some(d) => {
                let _ = writeln!(
                    out,
                    "    {:<w2$} {:>10} {:>10}",
                    "device used (total - free)",
                    "",
                    mib1(d.used),
                    w2 = w - 2
                );
                if d.other_processes > 0 {
                    let _ = writeln!(
                        out,
                        "    {:<w2$} {:>10} {:>10}",
                        "other processes",
                        "",
                        mib1(d.other_processes),
                        w2 = w - 2
                    );
                }
                let _ = writeln!(
                    out,
                    "    {:<w2$} {:>10} {:>10}",
                    "unattributed residual",
                    "",
                    format!("{:.1}", d.unattributed as f64 / MIB as f64),
                    w2 = w - 2
                );
                let _ = writeln!(
                    out,
                    "  attribution {:.1} % of {} MiB in use (target >= {:.0} %): {}",
                    d.attribution_pct,
                    mib1(d.own_used),
                    ATTRIBUTION_TARGET * 100.0,
                    if d.meets_target { "met" } else { "NOT met" }
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "  no device reading (this backend has no real device): the check that every \
                     byte the device reports in use is attributed runs on a GPU only"
                );
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "  {:<12} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>12}",
            "tag", "reserved", "committed", "live", "peak", "acquired", "released", "steady-state"
        );
        for t in self
            .tags
            .iter()
            .filter(|t| t.acquisitions > 0 || t.steady_state_allocations > 0)
        {
            let _ = writeln!(
                out,
                "    {:<10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>12}",
                t.tag,
                mib1(t.reserved),
                mib1(t.committed),
                mib1(t.live),
                mib1(t.peak),
                t.acquisitions,
                t.releases,
                t.steady_state_allocations
            );
        }
        let _ = writeln!(
            out,
            "  steady-state allocations while serving: {}",
            self.steady_state_allocations_total
        );
        out
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Result<String, MemError> {
        serde_json::to_string_pretty(self)
            .map_err(|err| MemError::Invariant(format!("memory report does not serialise: {err}")))
    }
}
