//! Prometheus metrics (`GET /metrics`, the text exposition format):
//! histograms of the fork's pause and of each child's time to running,
//! wakes, API requests; and, computed at each scrape, vms by state, store
//! bytes and lazy page-in faults.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

/// Millisecond buckets from 0.1 ms to ~6.5 s.
fn ms_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.0, 17)
}

/// Everything tined counts.
pub struct Metrics {
    registry: Registry,
    pub fork_pause: Histogram,
    pub fork_child_running: Histogram,
    pub fork_total: Histogram,
    pub forks: Counter,
    pub wakes: Family<KindLabel, Counter>,
    pub requests: Family<RequestLabels, Counter>,
    pub operations: Family<KindLabel, Counter>,
    vms: Family<StateLabel, Gauge>,
    store_bytes: Gauge,
    pagein_faults: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tine");
        let fork_pause = Histogram::new(ms_buckets());
        let fork_child_running = Histogram::new(ms_buckets());
        let fork_total = Histogram::new(ms_buckets());
        let forks = Counter::default();
        let wakes = Family::<KindLabel, Counter>::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let operations = Family::<KindLabel, Counter>::default();
        let vms = Family::<StateLabel, Gauge>::default();
        let store_bytes = Gauge::default();
        let pagein_faults = Gauge::default();
        registry.register(
            "fork_pause_seconds",
            "How long the guest was paused for a fork",
            fork_pause.clone(),
        );
        registry.register(
            "fork_child_running_seconds",
            "From the fork request to each child running",
            fork_child_running.clone(),
        );
        registry.register(
            "fork_seconds",
            "A fork from the request to every copy woken",
            fork_total.clone(),
        );
        registry.register("forks", "Forks done", forks.clone());
        registry.register(
            "wakes",
            "Copies woken (boot, child, restored, rollback, branch)",
            wakes.clone(),
        );
        registry.register("api_requests", "API requests answered", requests.clone());
        registry.register(
            "operations",
            "Long operations finished, by kind",
            operations.clone(),
        );
        registry.register("vms", "Vms by state", vms.clone());
        registry.register(
            "store_stored_bytes",
            "Bytes the snapshot store holds (compressed chunks)",
            store_bytes.clone(),
        );
        registry.register(
            "pagein_faults",
            "Page faults served by lazy page-in, over the running vms",
            pagein_faults.clone(),
        );
        Metrics {
            registry,
            fork_pause,
            fork_child_running,
            fork_total,
            forks,
            wakes,
            requests,
            operations,
            vms,
            store_bytes,
            pagein_faults,
        }
    }
}

/// What a scrape reads from the engine.
pub struct Sample {
    pub vms_by_state: Vec<(String, i64)>,
    pub store_bytes: Option<u64>,
    pub pagein_faults: u64,
}

impl Metrics {
    /// The text exposition of everything, with `sample` as the gauges.
    pub fn render(&self, sample: &Sample) -> String {
        for s in ["running", "stopped", "crashed", "sleeping"] {
            self.vms
                .get_or_create(&StateLabel { state: s.into() })
                .set(0);
        }
        for (s, n) in &sample.vms_by_state {
            self.vms
                .get_or_create(&StateLabel { state: s.clone() })
                .set(*n);
        }
        if let Some(b) = sample.store_bytes {
            self.store_bytes.set(i64::try_from(b).unwrap_or(i64::MAX));
        }
        self.pagein_faults
            .set(i64::try_from(sample.pagein_faults).unwrap_or(i64::MAX));
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.push_str("# metrics could not be encoded\n");
        }
        out
    }
}
