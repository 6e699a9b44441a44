//! A route's request rate per key (TRAFFIC.md §6): GCRA, one cell of atomics per key in a table
//! of fixed size, allocated once when the route's limit is compiled. A request looks its key up
//! in one bucket of [`WAYS`] tags (one cache line) and moves the key's theoretical arrival time
//! (TAT) with one compare-and-swap: no lock, no allocation, whatever the number of clients.
//!
//! A key not in the table takes the bucket's slot with the earliest TAT: the idlest key, and
//! one whose TAT has passed is at rest, so forgetting it changes nothing it would be told.
//!
//! Under `scope: cluster` each key may run at its own share of the rate (set by the control
//! task from every gateway's demand), and the limiter counts the requests each key offers.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::time::Instant;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::model::{RateLimit, RateLimitKey, RateLimitScope};

/// Slots per bucket: their tags fill one 64-byte cache line.
pub const WAYS: usize = 8;

/// Keys hash with fixed seeds so that gateways sharing a store name a key alike. A client that
/// could aim a collision at another's key would need that key's value, and could send it. Header
/// values and addresses hash apart: a header holding an address's bytes is not that address.
const KEY_SEED: u64 = 0x7261_6168_692d_726c;
const ADDRESS_SEED: u64 = 0x7261_6168_692d_6970;

/// Tag of the route-wide key (`key: "route"`); 0 marks an empty slot.
const ROUTE_KEY: u64 = 1;

const NANOS_PER_SECOND: f64 = 1e9;

/// One key's state. `tat` is nanoseconds since the limiter's epoch; 0 is "at rest".
#[derive(Debug, Default)]
struct Cell {
    tat: AtomicU64,
    /// This gateway's emission interval for the key under a cluster share; 0: the limiter's.
    interval_ns: AtomicU64,
    /// Requests offered (admitted or not) since the control task last took the count, with
    /// [`REFUSED`] set once one was refused; only under `scope: cluster`.
    offered: AtomicU32,
}

/// The `offered` bit that says a request was refused since the count was last taken.
const REFUSED: u32 = 1 << 31;

#[derive(Debug, Default)]
#[repr(align(64))]
struct Bucket {
    tags: [AtomicU64; WAYS],
    cells: [Cell; WAYS],
}

/// What a request's check decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Admitted; `remaining` more requests would be admitted at once now.
    Admitted { remaining: u64 },
    /// Refused; one would be admitted after `retry_after_ns`.
    Limited { retry_after_ns: u64 },
}

/// How a key is used, as the control task reads it for a cluster share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyUse {
    pub key: u64,
    /// Requests offered since the last read.
    pub offered: u32,
    /// The key runs at its own share of the rate.
    pub shared: bool,
    /// The key is near its limit here: a request was refused since the last read, or more
    /// than half its burst is spent.
    pub near_limit: bool,
}

/// The compiled limit of one route, carried across snapshots while its `rate_limit` is unchanged.
#[derive(Debug)]
pub struct RateLimiter {
    spec: RateLimit,
    /// `key: {"header": name}`'s name, parsed once.
    header: Option<http::HeaderName>,
    epoch: Instant,
    /// The whole rate's emission interval.
    full_interval_ns: u64,
    /// The interval of a key without a share of its own: the whole rate's, or under `cluster`
    /// this gateway's default share of it.
    default_interval_ns: AtomicU64,
    /// Burst × the whole rate's interval: how far ahead of now a key's TAT may run. A share's
    /// burst shrinks with its rate, so this is the same for every gateway and key.
    tolerance_ns: u64,
    buckets: Box<[Bucket]>,
    /// Slots ever taken from empty: the keys tracked, up to the capacity.
    keys: AtomicU64,
    /// Keys forgotten to make room for another.
    pub evicted: AtomicU64,
    pub admitted: AtomicU64,
    pub limited: AtomicU64,
}

impl RateLimiter {
    pub fn new(spec: &RateLimit) -> RateLimiter {
        let full_interval_ns = interval_ns(spec.requests_per_second);
        let bucket_count = (spec.max_keys.max(1) as usize).div_ceil(WAYS);
        let header = match &spec.key {
            RateLimitKey::Header(name) => http::HeaderName::from_bytes(name.as_bytes()).ok(),
            _ => None,
        };
        RateLimiter {
            header,
            epoch: Instant::now(),
            full_interval_ns,
            default_interval_ns: AtomicU64::new(full_interval_ns),
            tolerance_ns: full_interval_ns.saturating_mul(u64::from(spec.effective_burst())),
            buckets: std::iter::repeat_with(Bucket::default)
                .take(bucket_count)
                .collect(),
            keys: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            spec: spec.clone(),
        }
    }

    pub fn spec(&self) -> &RateLimit {
        &self.spec
    }

    /// Keys the table holds at most.
    pub fn capacity(&self) -> usize {
        self.buckets.len() * WAYS
    }

    /// Keys tracked now.
    pub fn keys(&self) -> u64 {
        self.keys
            .load(Ordering::Relaxed)
            .min(self.capacity() as u64)
    }

    /// The key of a request: its client's address, a header's value (a request without the
    /// header is keyed by its client's address), or the route's one key.
    pub fn key_of(&self, headers: &http::HeaderMap, client: std::net::IpAddr) -> u64 {
        if self.spec.key == RateLimitKey::Route {
            return ROUTE_KEY;
        }
        let value = self.header.as_ref().and_then(|name| headers.get(name));
        let hash = match value {
            Some(value) => xxh3_64_with_seed(value.as_bytes(), KEY_SEED),
            None => client_key(client),
        };
        hash.max(ROUTE_KEY + 1)
    }

    /// Admits or refuses one request of `key` at `now`.
    pub fn check(&self, key: u64, now: Instant) -> Decision {
        let now_ns = self.nanos_since_epoch(now);
        let cell = self.cell(key);
        if self.spec.scope == RateLimitScope::Cluster {
            cell.offered.fetch_add(1, Ordering::Relaxed);
        }
        let interval = match cell.interval_ns.load(Ordering::Relaxed) {
            0 => self.default_interval_ns.load(Ordering::Relaxed),
            own => own,
        };
        // A share slower than one burst still admits one request per interval.
        let tolerance = self.tolerance_ns.max(interval);
        let mut tat = cell.tat.load(Ordering::Relaxed);
        loop {
            let next = tat.max(now_ns).saturating_add(interval);
            let ahead = next - now_ns;
            if ahead > tolerance {
                self.limited.fetch_add(1, Ordering::Relaxed);
                if self.spec.scope == RateLimitScope::Cluster {
                    cell.offered.fetch_or(REFUSED, Ordering::Relaxed);
                }
                return Decision::Limited {
                    retry_after_ns: ahead - tolerance,
                };
            }
            match cell
                .tat
                .compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.admitted.fetch_add(1, Ordering::Relaxed);
                    return Decision::Admitted {
                        remaining: (tolerance - ahead) / interval,
                    };
                }
                Err(current) => tat = current,
            }
        }
    }

    /// The cell of `key`, taking the idlest slot of its bucket when the key is new.
    fn cell(&self, key: u64) -> &Cell {
        let bucket = &self.buckets[self.bucket_index(key)];
        if let Some(way) = find(bucket, key) {
            return &bucket.cells[way];
        }
        let way = bucket
            .cells
            .iter()
            .enumerate()
            .min_by_key(|(_, cell)| cell.tat.load(Ordering::Relaxed))
            .map_or(0, |(way, _)| way);
        let old = bucket.tags[way].swap(key, Ordering::Relaxed);
        let cell = &bucket.cells[way];
        if old == 0 {
            self.keys.fetch_add(1, Ordering::Relaxed);
        } else if old != key {
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        if old != key {
            // A request of the key forgotten may move this TAT between the swap and here: one
            // request's worth, only when a bucket is full of keys and two race for a slot.
            cell.tat.store(0, Ordering::Relaxed);
            cell.interval_ns.store(0, Ordering::Relaxed);
            cell.offered.store(0, Ordering::Relaxed);
        }
        cell
    }

    fn bucket_index(&self, key: u64) -> usize {
        // Multiply-shift: any table size, no division.
        ((u128::from(key.rotate_left(17)) * self.buckets.len() as u128) >> 64) as usize
    }

    fn nanos_since_epoch(&self, now: Instant) -> u64 {
        // Offset by one so that 0 stays "at rest".
        now.saturating_duration_since(self.epoch).as_nanos() as u64 + 1
    }

    /// The whole rate, per second.
    pub fn rate(&self) -> f64 {
        self.spec.requests_per_second
    }

    /// The rate a key without a share of its own runs at on this gateway, per second.
    pub fn default_rate(&self) -> f64 {
        rate_of(self.default_interval_ns.load(Ordering::Relaxed))
    }

    /// Sets the rate of keys without a share of their own (under `cluster`, this gateway's
    /// default share of the whole rate).
    pub fn set_default_rate(&self, per_second: f64) {
        self.default_interval_ns
            .store(self.interval_for(per_second), Ordering::Relaxed);
    }

    /// Gives `key` its own rate on this gateway (None: back to the default); false when the
    /// key is no longer tracked.
    pub fn set_share(&self, key: u64, per_second: Option<f64>) -> bool {
        let bucket = &self.buckets[self.bucket_index(key)];
        let Some(way) = find(bucket, key) else {
            return false;
        };
        let interval = per_second.map_or(0, |rate| self.interval_for(rate));
        bucket.cells[way]
            .interval_ns
            .store(interval, Ordering::Relaxed);
        true
    }

    /// The rate `key` runs at on this gateway, per second; None when it is not tracked.
    pub fn rate_of_key(&self, key: u64) -> Option<f64> {
        let bucket = &self.buckets[self.bucket_index(key)];
        let way = find(bucket, key)?;
        Some(
            match bucket.cells[way].interval_ns.load(Ordering::Relaxed) {
                0 => self.default_rate(),
                own => rate_of(own),
            },
        )
    }

    /// Every tracked key that offered requests since the last call, or runs at a share of its
    /// own; takes the offered counts.
    pub fn take_use(&self, now: Instant, mut each: impl FnMut(KeyUse)) {
        let now_ns = self.nanos_since_epoch(now);
        let half_burst = self.tolerance_ns / 2;
        for bucket in self.buckets.iter() {
            for way in 0..WAYS {
                let key = bucket.tags[way].load(Ordering::Relaxed);
                if key == 0 {
                    continue;
                }
                let cell = &bucket.cells[way];
                // Read before taking: a quiet key's cache line is not written.
                let offered = match cell.offered.load(Ordering::Relaxed) {
                    0 => 0,
                    _ => cell.offered.swap(0, Ordering::Relaxed),
                };
                let shared = cell.interval_ns.load(Ordering::Relaxed) != 0;
                if offered > 0 || shared {
                    let spent = cell.tat.load(Ordering::Relaxed).saturating_sub(now_ns);
                    each(KeyUse {
                        key,
                        offered: offered & !REFUSED,
                        shared,
                        near_limit: offered & REFUSED != 0 || spent > half_burst,
                    });
                }
            }
        }
    }

    /// An interval no faster than the whole rate and no slower than a request a day.
    fn interval_for(&self, per_second: f64) -> u64 {
        interval_ns(per_second).max(self.full_interval_ns)
    }
}

fn find(bucket: &Bucket, key: u64) -> Option<usize> {
    bucket
        .tags
        .iter()
        .position(|tag| tag.load(Ordering::Relaxed) == key)
}

/// An IPv4 client is its address; an IPv6 client its /64, the smallest network a site or a
/// subscriber is given (RFC 6177): each address of it would otherwise be a key of its own.
fn client_key(client: std::net::IpAddr) -> u64 {
    let octets = match client.to_canonical() {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => (u128::from(v6) & !u128::from(u64::MAX)).to_be_bytes(),
    };
    xxh3_64_with_seed(&octets, ADDRESS_SEED)
}

/// Longest emission interval: one request a day.
const MAX_INTERVAL_NS: u64 = 86_400_000_000_000;

fn interval_ns(per_second: f64) -> u64 {
    if per_second.is_finite() && per_second > 0.0 {
        ((NANOS_PER_SECOND / per_second).round() as u64).clamp(1, MAX_INTERVAL_NS)
    } else {
        MAX_INTERVAL_NS
    }
}

fn rate_of(interval_ns: u64) -> f64 {
    NANOS_PER_SECOND / interval_ns.max(1) as f64
}

#[cfg(test)]
mod tests;
