//! Sources whose lifecycle, guard, watch, error or answer moved since last reported.

use std::collections::HashMap;

use super::Observer;
use crate::control::sources::SourceEntry;
use crate::events::{EventBody, SourceChangeKind, SourceEvent};
use crate::model::{Id, SourceProgress, SourceState, SourceStatus};

/// A source event ready but for `status.refreshed_by` of a source another instance refreshes
/// (the control task asks the store who holds its lease).
pub struct SourceNews {
    pub service_id: Id,
    pub event: SourceEvent,
    pub holder_unknown: bool,
}

impl Observer {
    /// The events of sources whose progress moved since last reported (and remembers it),
    /// among `candidates` (None: every source).
    pub(in crate::control) fn source_news(
        &mut self,
        entries: &HashMap<Id, SourceEntry>,
        candidates: Option<Vec<Id>>,
    ) -> Vec<SourceNews> {
        if !self.primed {
            return Vec::new();
        }
        let moved_since = |id: &Id| {
            entries
                .get(id)
                .is_some_and(|entry| self.progress.get(id) != Some(&entry.progress))
        };
        let mut moved: Vec<Id> = match candidates {
            Some(ids) => ids.into_iter().filter(moved_since).collect(),
            None => entries.keys().copied().filter(moved_since).collect(),
        };
        moved.sort_unstable();
        moved.dedup();
        let mut news = Vec::new();
        for id in moved {
            let entry = &entries[&id];
            let changes = match self.progress.get(&id) {
                Some(before) => describe_source_change(before, &entry.progress),
                None => Vec::new(),
            };
            for (change, from, to, reason) in changes {
                news.push(SourceNews {
                    service_id: entry.source.service_id,
                    event: SourceEvent {
                        source_id: id,
                        name: entry.source.name.clone(),
                        change,
                        from,
                        to,
                        reason,
                        status: self.status_of(entry, &entry.progress),
                    },
                    holder_unknown: !entry.holds_lease(),
                });
            }
            self.progress.insert(id, entry.progress.clone());
        }
        if self.progress.len() > entries.len() {
            self.progress.retain(|id, _| entries.contains_key(id));
        }
        news
    }

    pub(in crate::control) fn record_source(&self, news: SourceNews) {
        self.log
            .record(Some(news.service_id), EventBody::Source(news.event));
    }

    /// The status `GET /discovery-sources/{id}/status` would answer, as this instance knows it.
    pub(super) fn status_of(&self, entry: &SourceEntry, progress: &SourceProgress) -> SourceStatus {
        SourceStatus {
            source_id: entry.source.id,
            progress: progress.clone(),
            endpoints: self
                .counts
                .get(&entry.source.id)
                .copied()
                .unwrap_or_default(),
            refreshed_by: entry.holds_lease().then(|| self.instance_id.clone()),
            removal_acceptance: entry.acceptance.clone(),
        }
    }
}

type SourceChange = (SourceChangeKind, Option<String>, Option<String>, String);

fn describe_source_change(before: &SourceProgress, after: &SourceProgress) -> Vec<SourceChange> {
    let mut changes = Vec::new();
    if before.state != after.state {
        changes.push((
            SourceChangeKind::State,
            Some(before.state.as_str().to_owned()),
            Some(after.state.as_str().to_owned()),
            state_reason(before.state, after),
        ));
    } else if before.last_error != after.last_error {
        if let Some(error) = &after.last_error {
            changes.push((SourceChangeKind::Error, None, None, error.clone()));
        }
    }
    fn held(progress: &SourceProgress) -> Option<(&[String], &str)> {
        let hold = progress.guard.as_ref()?;
        Some((&hold.held, &hold.reason))
    }
    if held(before) != held(after) {
        let reason = match &after.guard {
            Some(hold) => format!("holding {} removals: {}", hold.held.len(), hold.reason),
            None => "the removal guard holds nothing any more".to_owned(),
        };
        changes.push((SourceChangeKind::Guard, None, None, reason));
    }
    let connected = |progress: &SourceProgress| progress.watch.as_ref().map(|w| w.connected);
    if connected(before) != connected(after) {
        let reason = match (connected(after), &after.last_error) {
            (Some(true), _) => "watch connected".to_owned(),
            (_, Some(error)) => format!("watch lost: {error}"),
            (_, None) => "watch not connected".to_owned(),
        };
        changes.push((SourceChangeKind::Watch, None, None, reason));
    }
    // A new answer (the set changed) without a change of state: when it was refreshed.
    if before.revision != after.revision && before.state == after.state {
        if let Some(revision) = &after.revision {
            changes.push((
                SourceChangeKind::Revision,
                None,
                Some(revision.clone()),
                "the registry answered a changed set".to_owned(),
            ));
        }
    }
    changes
}

fn state_reason(before: SourceState, after: &SourceProgress) -> String {
    match (after.state, &after.last_error) {
        (SourceState::Failing | SourceState::Stale, Some(error)) => error.clone(),
        (SourceState::Healthy, _) if before == SourceState::Pending => {
            "first successful refresh".to_owned()
        }
        (SourceState::Healthy, _) => "refreshed successfully again".to_owned(),
        (SourceState::Disabled, _) => "disabled".to_owned(),
        (SourceState::Pending, _) => "waiting for its first refresh".to_owned(),
        (state, None) => state.as_str().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{GuardHold, WatchProgress};

    fn progress(state: SourceState) -> SourceProgress {
        SourceProgress {
            state,
            last_error: None,
            last_refresh_at: None,
            last_success_at: None,
            next_refresh_at: None,
            revision: None,
            failing_since: None,
            watch: None,
            guard: None,
        }
    }

    fn kinds(changes: &[SourceChange]) -> Vec<SourceChangeKind> {
        changes.iter().map(|change| change.0).collect()
    }

    #[test]
    fn each_facet_of_progress_is_its_own_change() {
        let healthy = progress(SourceState::Healthy);
        let mut failing = progress(SourceState::Failing);
        failing.last_error = Some("registry answered HTTP 500".into());
        let changes = describe_source_change(&healthy, &failing);
        assert_eq!(kinds(&changes), [SourceChangeKind::State]);
        assert_eq!(changes[0].3, "registry answered HTTP 500");

        let mut other_error = failing.clone();
        other_error.last_error = Some("connection refused".into());
        assert_eq!(
            kinds(&describe_source_change(&failing, &other_error)),
            [SourceChangeKind::Error]
        );

        let mut holding = healthy.clone();
        holding.guard = Some(GuardHold {
            holding: 2,
            held: vec!["a".into(), "b".into()],
            since: crate::clock::now(),
            confirmations: 1,
            base: 3,
            reason: "2 of 3".into(),
        });
        let changes = describe_source_change(&healthy, &holding);
        assert_eq!(kinds(&changes), [SourceChangeKind::Guard]);
        assert_eq!(changes[0].3, "holding 2 removals: 2 of 3");
        // Another confirmation of the same hold is not news.
        let mut confirmed = holding.clone();
        if let Some(hold) = confirmed.guard.as_mut() {
            hold.confirmations = 2;
        }
        assert!(describe_source_change(&holding, &confirmed).is_empty());

        let mut watching = healthy.clone();
        watching.watch = Some(WatchProgress {
            connected: true,
            since: crate::clock::now(),
            index: Some("7".into()),
        });
        assert_eq!(
            kinds(&describe_source_change(&healthy, &watching)),
            [SourceChangeKind::Watch]
        );

        let mut answered = healthy.clone();
        answered.revision = Some("r2".into());
        answered.last_refresh_at = Some(crate::clock::now());
        assert_eq!(
            kinds(&describe_source_change(&healthy, &answered)),
            [SourceChangeKind::Revision]
        );
        // A refresh that changed nothing but its times is not news.
        let mut refreshed = healthy.clone();
        refreshed.last_refresh_at = Some(crate::clock::now());
        assert!(describe_source_change(&healthy, &refreshed).is_empty());
    }
}
