//! Prometheus metrics of the controller: requests by route and code, request latency, and
//! machines by condition (counted when scraped).

use std::time::Duration;

use keelson_api::machine::Machine;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    method: String,
    code: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
    method: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConditionLabels {
    condition: String,
    status: String,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~33 s
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.0005, 2.0, 17))
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Family<RouteLabels, Histogram, fn() -> Histogram>,
    machines: Family<ConditionLabels, Gauge>,
    machines_total: Gauge,
    leader: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("keelson");
        let requests = Family::<RequestLabels, Counter>::default();
        let latency = Family::<RouteLabels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let machines = Family::<ConditionLabels, Gauge>::default();
        let machines_total = Gauge::default();
        let leader = Gauge::default();
        registry.register("http_requests", "HTTP requests answered, by route, method and status code", requests.clone());
        registry.register("http_request_duration_seconds", "Time to answer an HTTP request (long-polls include the wait)", latency.clone());
        registry.register("machines_by_condition", "Machines by condition type and status", machines.clone());
        registry.register("machines", "Machines known to the controller", machines_total.clone());
        registry.register("controller_leader", "1 while this replica runs the fleet's rollout and reachability loops", leader.clone());
        Metrics { registry, requests, latency, machines, machines_total, leader }
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    pub fn observe_request(&self, route: &str, method: &str, code: u16, elapsed: Duration) {
        self.requests.get_or_create(&RequestLabels { route: route.to_owned(), method: method.to_owned(), code }).inc();
        self.latency.get_or_create(&RouteLabels { route: route.to_owned(), method: method.to_owned() }).observe(elapsed.as_secs_f64());
    }

    /// Renders the text exposition, counting machines by condition first.
    pub fn render(&self, machines: &[Machine]) -> String {
        self.machines.clear();
        self.machines_total.set(machines.len() as i64);
        for m in machines {
            for c in &m.status.conditions {
                self.machines.get_or_create(&ConditionLabels { condition: c.type_.clone(), status: c.status.to_string() }).inc();
            }
        }
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
