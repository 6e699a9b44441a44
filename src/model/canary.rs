//! A route's canary (TRAFFIC.md §4): one backend's share of the route's requests moved step by
//! step while it behaves, and set to 0 the first interval it does not. The configuration is the
//! route's; where the canary stands (its state, step and weight) is runtime state the store
//! keeps beside the route, written by the gateway holding the route's canary lease or by an
//! operator's action, and applied by every gateway like any other configuration change.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Route `canary`, on a route with two or more backends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Canary {
    /// The position in `backends` of the backend being introduced.
    pub backend: u32,
    /// The canary backend's percent of the route's requests at each step, strictly rising,
    /// the last 100.
    #[serde(default = "default_steps")]
    pub steps: Vec<u8>,
    /// How long one step is judged before the next.
    #[serde(default = "default_step_interval_ms")]
    pub step_interval_ms: u64,
    /// Requests the canary backend must serve in an interval for it to be judged; fewer hold
    /// the step.
    #[serde(default = "default_min_requests")]
    pub min_requests: u64,
    /// Most errors (5xx, upstream failures, gRPC UNAVAILABLE, INTERNAL, UNKNOWN,
    /// DEADLINE_EXCEEDED) in percent of the canary's requests in an interval.
    #[serde(default = "default_max_error_percent")]
    pub max_error_percent: f64,
    /// Highest p99 of the canary's time to response headers in an interval; null: not judged.
    #[serde(default)]
    pub max_p99_ms: Option<u64>,
}

fn default_steps() -> Vec<u8> {
    vec![5, 25, 50, 100]
}

fn default_step_interval_ms() -> u64 {
    60_000
}

fn default_min_requests() -> u64 {
    100
}

fn default_max_error_percent() -> f64 {
    1.0
}

/// Shortest `step_interval_ms`: gateways exchange their counts once a second, so a shorter
/// interval would be judged on a fraction of the cluster's traffic.
pub const MIN_CANARY_INTERVAL_MS: u64 = 1_000;

impl Canary {
    /// The canary backend's position in `backends`.
    pub fn backend_index(&self) -> usize {
        self.backend as usize
    }

    /// The weight (percent) of step `index`; past the last, the last.
    pub fn step_weight(&self, index: usize) -> u8 {
        self.steps
            .get(index)
            .or(self.steps.last())
            .copied()
            .unwrap_or(100)
    }
}

/// Where a canary stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CanaryState {
    /// Judged every interval; steps up while in bounds.
    Progressing,
    /// Held at its weight by an operator; not judged.
    Paused,
    /// At 100 %: every step passed, or an operator promoted it.
    Promoted,
    /// At 0 %: an interval out of bounds, or an operator rolled it back.
    RolledBack,
}

impl CanaryState {
    pub fn as_str(self) -> &'static str {
        match self {
            CanaryState::Progressing => "progressing",
            CanaryState::Paused => "paused",
            CanaryState::Promoted => "promoted",
            CanaryState::RolledBack => "rolled_back",
        }
    }

    pub fn parse(text: &str) -> Option<CanaryState> {
        [
            CanaryState::Progressing,
            CanaryState::Paused,
            CanaryState::Promoted,
            CanaryState::RolledBack,
        ]
        .into_iter()
        .find(|state| state.as_str() == text)
    }
}

/// Where a route's canary stands now, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CanaryStatus {
    pub state: CanaryState,
    /// The step in force (0-based position in `steps`).
    pub step: u32,
    /// The canary backend's percent of the route's requests now.
    pub weight: u8,
    /// Counts one at every decision; the interval being judged began with it.
    pub round: i64,
    /// When the interval being judged began (epoch milliseconds, the store's clock).
    pub interval_started_ms: i64,
    /// Why the canary is where it is.
    pub reason: String,
}

/// What an operator may ask of a canary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CanaryAction {
    Pause,
    Resume,
    Promote,
    Rollback,
}

impl CanaryAction {
    pub fn parse(text: &str) -> Option<CanaryAction> {
        match text {
            "pause" => Some(CanaryAction::Pause),
            "resume" => Some(CanaryAction::Resume),
            "promote" => Some(CanaryAction::Promote),
            "rollback" => Some(CanaryAction::Rollback),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CanaryAction::Pause => "pause",
            CanaryAction::Resume => "resume",
            CanaryAction::Promote => "promote",
            CanaryAction::Rollback => "rollback",
        }
    }
}

/// Where a canary goes next. Every transition starts a new interval.
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryMove {
    pub state: CanaryState,
    pub step: u32,
    pub weight: u8,
    pub reason: String,
}

impl CanaryMove {
    /// A new (or changed) canary: its first step, judged from now.
    pub fn start(canary: &Canary) -> CanaryMove {
        CanaryMove {
            state: CanaryState::Progressing,
            step: 0,
            weight: canary.step_weight(0),
            reason: format!("started at step 1 ({} %)", canary.step_weight(0)),
        }
    }

    /// What an operator's `action` makes of a canary at `status`; an error names why it may
    /// not be taken. Pausing a paused canary (and the like) moves nothing but is no error.
    pub fn after_action(
        canary: &Canary,
        status: &CanaryStatus,
        action: CanaryAction,
    ) -> Result<CanaryMove, String> {
        let kept = |reason: String| CanaryMove {
            state: status.state,
            step: status.step,
            weight: status.weight,
            reason,
        };
        Ok(match (action, status.state) {
            (CanaryAction::Pause, CanaryState::Progressing) => CanaryMove {
                state: CanaryState::Paused,
                ..kept(format!("paused by an operator at {} %", status.weight))
            },
            (CanaryAction::Pause, CanaryState::Paused) => kept(status.reason.clone()),
            (CanaryAction::Pause, finished) => {
                return Err(format!(
                    "the canary is {}; there is nothing to pause",
                    finished.as_str()
                ))
            }
            (CanaryAction::Resume, CanaryState::Paused) => CanaryMove {
                state: CanaryState::Progressing,
                ..kept(format!("resumed by an operator at {} %", status.weight))
            },
            (CanaryAction::Resume, CanaryState::Progressing) => kept(status.reason.clone()),
            (CanaryAction::Resume, CanaryState::RolledBack) => CanaryMove {
                reason: format!(
                    "resumed by an operator after a rollback: step 1 ({} %) again",
                    canary.step_weight(0)
                ),
                ..CanaryMove::start(canary)
            },
            (CanaryAction::Resume, CanaryState::Promoted) => {
                return Err("the canary is promoted; change the route to start another".to_owned())
            }
            (CanaryAction::Promote, _) => CanaryMove {
                state: CanaryState::Promoted,
                step: last_step(canary),
                weight: 100,
                reason: "promoted by an operator".to_owned(),
            },
            (CanaryAction::Rollback, _) => CanaryMove {
                state: CanaryState::RolledBack,
                step: status.step,
                weight: 0,
                reason: "rolled back by an operator".to_owned(),
            },
        })
    }
}

/// The position of the canary's last step.
pub fn last_step(canary: &Canary) -> u32 {
    u32::try_from(canary.steps.len().saturating_sub(1)).unwrap_or(u32::MAX)
}

/// One backend's requests in a judged interval, as the history shows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct IntervalCounts {
    pub requests: u64,
    pub errors: u64,
    pub error_percent: f64,
    /// Null without timed requests.
    pub p99_ms: Option<f64>,
}

impl IntervalCounts {
    pub fn of(counts: &CanaryCounts) -> IntervalCounts {
        IntervalCounts {
            requests: counts.requests,
            errors: counts.errors,
            error_percent: counts.error_percent(),
            p99_ms: counts.p99_ms().filter(|p99| p99.is_finite()),
        }
    }
}

/// One entry of a canary's history: a decision of the gateway judging it, or an operator's
/// action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CanaryDecision {
    pub round: i64,
    /// When (the store's clock).
    pub at: chrono::DateTime<chrono::Utc>,
    pub state: CanaryState,
    pub step: u32,
    pub weight: u8,
    pub reason: String,
    /// The interval's counts by backend position, for decisions taken on them.
    pub counts: Vec<IntervalCounts>,
}

/// Buckets of [`CanaryCounts::latency`]: four per doubling from 250 µs, the last open-ended,
/// so a p99 read from them is at most 19 % above the true one.
pub const LATENCY_BUCKETS: usize = 72;
const FIRST_BOUND_MICROS: f64 = 250.0;

/// The upper bound of latency bucket `index` in microseconds (the last: unbounded).
pub fn latency_bound_micros(index: usize) -> f64 {
    if index + 1 >= LATENCY_BUCKETS {
        return f64::INFINITY;
    }
    FIRST_BOUND_MICROS * (index as f64 / 4.0).exp2()
}

/// The bucket a time to response headers falls in.
pub fn latency_bucket(micros: u64) -> usize {
    let ratio = micros as f64 / FIRST_BOUND_MICROS;
    if ratio <= 1.0 {
        return 0;
    }
    let index = (ratio.log2() * 4.0).ceil() as usize;
    // Float rounding may land a time on a bound one bucket high or low.
    let index = if index > 0 && (micros as f64) <= latency_bound_micros(index - 1) {
        index - 1
    } else {
        index
    };
    index.min(LATENCY_BUCKETS - 1)
}

/// One backend's requests over some time: how many, how many failed, and their times to
/// response headers.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CanaryCounts {
    pub requests: u64,
    pub errors: u64,
    /// Requests per latency bucket; shorter than [`LATENCY_BUCKETS`] when the last are empty.
    #[serde(default)]
    pub latency: Vec<u64>,
}

impl CanaryCounts {
    pub fn is_empty(&self) -> bool {
        self.requests == 0 && self.errors == 0
    }

    pub fn add(&mut self, other: &CanaryCounts) {
        self.requests += other.requests;
        self.errors += other.errors;
        if self.latency.len() < other.latency.len() {
            self.latency.resize(other.latency.len(), 0);
        }
        for (mine, theirs) in self.latency.iter_mut().zip(&other.latency) {
            *mine += theirs;
        }
    }

    /// Errors in percent of requests; 0 without requests.
    pub fn error_percent(&self) -> f64 {
        if self.requests == 0 {
            return 0.0;
        }
        self.errors as f64 * 100.0 / self.requests as f64
    }

    /// The latency bucket holding the 99th percentile; None without timed requests.
    pub fn p99_bucket(&self) -> Option<usize> {
        let timed: u64 = self.latency.iter().sum();
        if timed == 0 {
            return None;
        }
        // The smallest count that holds 99 % of the requests.
        let wanted = timed - timed / 100;
        let mut seen = 0;
        for (index, count) in self.latency.iter().enumerate() {
            seen += count;
            if seen >= wanted {
                return Some(index);
            }
        }
        Some(LATENCY_BUCKETS - 1)
    }

    /// The 99th percentile of the time to response headers in milliseconds, as the upper bound
    /// of its bucket (for display); None without timed requests, infinite in the last bucket.
    pub fn p99_ms(&self) -> Option<f64> {
        self.p99_bucket()
            .map(|bucket| latency_bound_micros(bucket) / 1000.0)
    }

    /// Whether the 99th percentile is certainly above `max_ms`: its whole bucket lies above
    /// it. A bucket spans up to 19 %, so a p99 just above the bound within its bucket passes;
    /// a p99 within bounds never fails.
    pub fn p99_above(&self, max_ms: u64) -> bool {
        self.p99_bucket().is_some_and(|bucket| {
            let lower_micros = match bucket {
                0 => 0.0,
                bucket => latency_bound_micros(bucket - 1),
            };
            lower_micros >= max_ms as f64 * 1000.0
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_falls_in_the_bucket_whose_bound_holds_it() {
        for micros in [
            0,
            1,
            250,
            251,
            297,
            298,
            1_000,
            12_345,
            60_000_000,
            u64::MAX,
        ] {
            let bucket = latency_bucket(micros);
            assert!(micros as f64 <= latency_bound_micros(bucket), "{micros} µs");
            if bucket > 0 {
                assert!(
                    micros as f64 > latency_bound_micros(bucket - 1),
                    "{micros} µs"
                );
            }
        }
        assert_eq!(latency_bucket(250), 0);
        assert_eq!(latency_bucket(500), 4);
        assert_eq!(latency_bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }

    #[test]
    fn the_p99_is_the_bound_of_the_bucket_holding_the_99th_percent() {
        let mut counts = CanaryCounts {
            requests: 100,
            errors: 0,
            latency: vec![0; LATENCY_BUCKETS],
        };
        counts.latency[latency_bucket(1_000)] = 99;
        counts.latency[latency_bucket(400_000)] = 1;
        assert_eq!(counts.p99_ms(), Some(1.0));
        counts.latency[latency_bucket(400_000)] = 2;
        let p99 = counts.p99_ms().unwrap();
        assert!((400.0..=480.0).contains(&p99), "{p99}");
        assert_eq!(CanaryCounts::default().p99_ms(), None);
    }

    #[test]
    fn counts_add_up_whatever_their_histogram_lengths() {
        let mut sum = CanaryCounts {
            requests: 3,
            errors: 1,
            latency: vec![1, 2],
        };
        sum.add(&CanaryCounts {
            requests: 4,
            errors: 2,
            latency: vec![0, 1, 3],
        });
        assert_eq!(sum.latency, vec![1, 3, 3]);
        assert_eq!((sum.requests, sum.errors), (7, 3));
        assert!((sum.error_percent() - 300.0 / 7.0).abs() < 1e-9);
    }
}
