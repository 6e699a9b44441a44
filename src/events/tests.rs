use super::*;

fn target_event(target_id: Id, change: TargetChangeKind, reason: &str) -> EventBody {
    EventBody::Target(TargetEvent {
        target_id,
        source_id: None,
        address: "127.0.0.1:8080".to_owned(),
        change,
        from: None,
        to: None,
        reason: reason.to_owned(),
        target: None,
    })
}

fn log(ring: usize, client_queue: usize) -> EventLog {
    EventLog::new(EventSettings { ring, client_queue })
}

fn offsets(events: &[Arc<Event>], base: u64) -> Vec<u64> {
    events.iter().map(|event| event.id - base).collect()
}

#[test]
fn ids_increase_and_the_ring_keeps_the_newest() {
    let log = log(3, 16);
    let base = log.last_id();
    let ids: Vec<u64> = (0..5)
        .map(|n| log.record(Some(1), target_event(n, TargetChangeKind::Added, "new")) - base)
        .collect();
    assert_eq!(ids, [1, 2, 3, 4, 5]);
    let kept = log
        .subscribe(Some(base + 2))
        .backlog
        .expect("3, 4, 5 are kept");
    assert_eq!(offsets(&kept, base), [3, 4, 5]);
}

#[test]
fn a_client_resumes_exactly_after_its_last_event_or_gets_a_snapshot() {
    let log = log(4, 16);
    let base = log.last_id();
    assert!(
        (1 << 52..1 << 53).contains(&base),
        "ids are exact as JavaScript numbers"
    );
    for n in 0..6 {
        log.record(Some(1), target_event(n, TargetChangeKind::Added, "new"));
    }
    // The ring holds 3..=6.
    let resumed = log.subscribe(Some(base + 4)).backlog.unwrap();
    assert_eq!(offsets(&resumed, base), [5, 6]);
    assert_eq!(log.subscribe(Some(base + 2)).backlog.unwrap().len(), 4);
    assert!(log.subscribe(Some(base + 6)).backlog.unwrap().is_empty());
    assert!(
        log.subscribe(Some(base + 1)).backlog.is_none(),
        "3 is the oldest kept"
    );
    assert!(
        log.subscribe(Some(base + 7)).backlog.is_none(),
        "an id from the future"
    );
    assert!(
        log.subscribe(Some(5)).backlog.is_none(),
        "an id from before a restart"
    );
    assert!(log.subscribe(None).backlog.is_none());
    assert_eq!(log.subscribe(None).last_id, base + 6);
}

/// Two gateways on one store started together: a browser whose stream moves from one to the
/// other must get a snapshot, never the second one's events after an id of the first.
#[test]
fn an_id_of_another_process_is_never_taken_for_one_of_this_ring() {
    let first = log(4_096, 16);
    let second = log(4_096, 16);
    for n in 0..2_000 {
        first.record(Some(1), target_event(n, TargetChangeKind::Added, "new"));
        second.record(Some(1), target_event(n, TargetChangeKind::Added, "new"));
    }
    for id in [first.last_id(), first.last_id() - 1_000] {
        assert!(
            second.subscribe(Some(id)).backlog.is_none(),
            "the second resumed after the first's id {id}"
        );
    }
}

#[tokio::test]
async fn a_subscriber_receives_every_event_after_subscribing_and_lags_when_full() {
    let log = log(100, 4);
    log.record(None, target_event(1, TargetChangeKind::Added, "before"));
    let mut subscription = log.subscribe(None);
    let after = log.record(None, target_event(2, TargetChangeKind::Added, "after"));
    assert_eq!(after, subscription.last_id + 1);
    assert_eq!(subscription.receiver.recv().await.unwrap().id, after);
    for n in 0..6 {
        log.record(None, target_event(n, TargetChangeKind::Updated, "burst"));
    }
    assert!(matches!(
        subscription.receiver.recv().await,
        Err(broadcast::error::RecvError::Lagged(_))
    ));
}

#[test]
fn the_frame_is_one_sse_event_with_the_id_time_and_body() {
    let log = log(10, 10);
    let base = log.last_id();
    let id = log.record(
        Some(9),
        target_event(7, TargetChangeKind::Ejected, "5 failures"),
    );
    let event = &log.subscribe(Some(base)).backlog.unwrap()[0];
    let text = std::str::from_utf8(&event.frame).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(format!("id: {id}").as_str()));
    assert_eq!(lines.next(), Some("event: target"));
    let data: serde_json::Value =
        serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(data["id"], id);
    assert_eq!(data["service_id"], 9);
    assert_eq!(data["target_id"], 7);
    assert_eq!(data["change"], "ejected");
    assert_eq!(data["reason"], "5 failures");
    assert!(data["at"].as_str().unwrap().ends_with('Z'));
    assert!(text.ends_with("\n\n"));
}

#[test]
fn history_is_newest_first_and_bounded_per_target() {
    let log = log(10, 10);
    for n in 0..(HISTORY_PER_TARGET + 5) {
        log.record(
            Some(1),
            target_event(3, TargetChangeKind::Health, &format!("check {n}")),
        );
    }
    log.record(Some(1), target_event(4, TargetChangeKind::Added, "other"));
    let history = log.history(3).unwrap();
    assert_eq!(history.len(), HISTORY_PER_TARGET);
    assert_eq!(
        history[0].reason,
        format!("check {}", HISTORY_PER_TARGET + 4)
    );
    assert_eq!(history.last().unwrap().reason, "check 5");
    assert!(history.windows(2).all(|pair| pair[0].id > pair[1].id));
    assert!(log.history(5).is_none());
}

#[test]
fn removed_targets_keep_their_history_until_many_more_are_removed() {
    let log = log(10, 10);
    log.record(
        Some(1),
        target_event(1, TargetChangeKind::Removed, "grace ended"),
    );
    assert_eq!(log.history(1).unwrap()[0].reason, "grace ended");
    for id in 2..=(RETIRED_HISTORIES as Id + 1) {
        log.record(Some(1), target_event(id, TargetChangeKind::Removed, "gone"));
    }
    assert!(
        log.history(1).is_none(),
        "the oldest removed history is forgotten"
    );
    assert!(log.history(2).is_some());
}

#[test]
fn config_and_source_events_are_named_by_kind() {
    let log = log(10, 10);
    let base = log.last_id();
    log.record(
        None,
        EventBody::Config(ConfigEvent {
            kind: ConfigKind::Route,
            object_id: 4,
            name: Some("api".into()),
            change: ConfigChangeKind::Deleted,
            object: None,
        }),
    );
    let event = &log.subscribe(Some(base)).backlog.unwrap()[0];
    let text = std::str::from_utf8(&event.frame).unwrap();
    assert!(text.starts_with(&format!("id: {}\nevent: config\ndata: {{", base + 1)));
    assert!(text.contains(r#""kind":"route""#) && text.contains(r#""change":"deleted""#));
}

#[test]
fn a_route_event_names_its_limit_and_refusals() {
    let log = log(10, 10);
    let base = log.last_id();
    log.record(
        Some(3),
        EventBody::Route(RouteEvent {
            route_id: 4,
            name: "api".into(),
            change: RouteChangeKind::Tripped,
            limit: RouteLimit::MaxInFlight,
            refused: 2,
            refused_total: 9,
            reason: "2 requests refused".into(),
        }),
    );
    let event = &log.subscribe(Some(base)).backlog.unwrap()[0];
    let text = std::str::from_utf8(&event.frame).unwrap();
    assert!(text.starts_with(&format!("id: {}\nevent: route\ndata: {{", base + 1)));
    let data: serde_json::Value =
        serde_json::from_str(text.lines().nth(2).unwrap().strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(data["service_id"], 3);
    assert_eq!(data["route_id"], 4);
    assert_eq!(data["change"], "tripped");
    assert_eq!(data["limit"], "max_in_flight");
    assert_eq!(
        (&data["refused"], &data["refused_total"]),
        (&2.into(), &9.into())
    );
}

#[test]
fn a_frame_holds_no_more_memory_than_its_bytes() {
    // Long enough that `format!` grows its buffer past the length several times.
    let reason = "a reason that makes the frame longer than a first guess ".repeat(20);
    for extra in 0..64 {
        let body = target_event(7, TargetChangeKind::Health, &reason[..reason.len() - extra]);
        let frame = frame(1, crate::clock::now(), Some(9), &body);
        let length = frame.len();
        let kept = frame.try_into_mut().expect("nobody else holds it");
        assert_eq!(
            kept.capacity(),
            length,
            "the ring keeps every frame for long"
        );
    }
}

#[test]
fn a_first_history_entry_takes_room_for_one() {
    let log = log(10, 10);
    log.record(Some(1), target_event(3, TargetChangeKind::Added, "created"));
    assert_eq!(
        log.lock().history[&3].capacity(),
        1,
        "one entry per target at start"
    );
    log.record(Some(1), target_event(3, TargetChangeKind::Health, "check"));
    assert_eq!(log.history(3).unwrap().len(), 2);
}

#[test]
fn the_ring_keeps_an_events_frame_without_its_body() {
    // The body (up to 568 bytes: a configuration event carries its service) is in the frame.
    assert!(
        std::mem::size_of::<Event>() <= 64,
        "an event is {} bytes",
        std::mem::size_of::<Event>()
    );
    let log = log(4, 16);
    log.record(Some(3), target_event(7, TargetChangeKind::Added, "new"));
    let kept = log.subscribe(Some(log.last_id() - 1)).backlog.unwrap();
    let (kind, data) = kept[0].parsed();
    assert_eq!(
        (kind.as_str(), &data["target_id"], &data["reason"]),
        ("target", &7.into(), &"new".into())
    );
}
