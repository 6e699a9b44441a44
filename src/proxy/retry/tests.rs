use super::*;
use crate::proxy::failure::UpstreamFailureKind;

fn policy(json: &str) -> RetryPolicy {
    serde_json::from_str(json).unwrap()
}

fn failure(kind: UpstreamFailureKind) -> UpstreamFailure {
    UpstreamFailure::new("web".into(), "10.0.0.7:80".into(), kind)
}

fn get() -> Resend<'static> {
    Resend {
        method: &Method::GET,
        body_repeatable: true,
        idempotency_key: false,
    }
}

fn post(idempotency_key: bool) -> Resend<'static> {
    Resend {
        method: &Method::POST,
        body_repeatable: true,
        idempotency_key,
    }
}

fn connect_failed() -> UpstreamFailure {
    failure(UpstreamFailureKind::ConnectFailed {
        reason: "refused".into(),
    })
}

fn reset() -> UpstreamFailure {
    failure(UpstreamFailureKind::Failed {
        reason: "reset".into(),
    })
}

fn late() -> UpstreamFailure {
    failure(UpstreamFailureKind::ResponseTimeout { timeout_ms: 100 })
}

fn refused_stream() -> UpstreamFailure {
    failure(UpstreamFailureKind::Unprocessed {
        reason: "REFUSED_STREAM".into(),
    })
}

fn status(rule: &RetryRule<'_>, code: u16, request: &Resend<'_>) -> Result<Retriable, NotRetried> {
    rule.after_answer(
        StatusCode::from_u16(code).unwrap(),
        &HeaderMap::new(),
        false,
        request,
    )
}

#[test]
fn without_a_route_policy_the_service_rules_hold() {
    let rule = RetryRule::of(None, 4);
    assert_eq!(rule.attempts, 4);
    assert_eq!(
        rule.after_failure(&connect_failed(), &post(false)),
        Some(RetryReason::ConnectFailure),
        "nothing reached the target"
    );
    assert_eq!(
        rule.after_failure(&refused_stream(), &post(false)),
        Some(RetryReason::Refused)
    );
    assert_eq!(
        rule.after_failure(&reset(), &get()),
        Some(RetryReason::Reset)
    );
    assert_eq!(rule.after_failure(&reset(), &post(false)), None);
    assert_eq!(
        rule.after_failure(&late(), &get()),
        None,
        "no per-try timeout"
    );
    assert_eq!(status(&rule, 503, &get()), Err(NotRetried::NotNamed));
    assert_eq!(rule.budget, RetryBudget::default());
    assert_eq!(rule.hedge_after, None);
    assert_eq!(RetryRule::of(None, 99).attempts, MAX_ATTEMPTS as usize);
}

#[test]
fn each_condition_names_its_statuses() {
    let cases: [(&str, &[u16], &[u16]); 5] = [
        (
            "gateway_error",
            &[502, 503, 504],
            &[500, 501, 505, 409, 429],
        ),
        ("5xx", &[500, 501, 502, 503, 504, 599], &[409, 429, 499]),
        ("retriable_4xx", &[409], &[400, 404, 429, 503]),
        ("retriable_status", &[429, 418], &[409, 503]),
        ("reset", &[], &[409, 429, 500, 503]),
    ];
    for (on, retried, passed) in cases {
        let policy = policy(&format!(r#"{{"on": ["{on}"], "statuses": [429, 418]}}"#));
        let rule = RetryRule::of(Some(&policy), 3);
        for code in retried {
            let retriable = status(&rule, *code, &get()).unwrap();
            assert_eq!(retriable.reason, RetryReason::Status, "{on} {code}");
        }
        for code in passed {
            assert_eq!(
                status(&rule, *code, &get()),
                Err(NotRetried::NotNamed),
                "{on} {code}"
            );
        }
    }
}

#[test]
fn a_per_try_timeout_is_retried_by_its_own_name_and_by_the_status_classes() {
    for on in ["per_try_timeout", "gateway_error", "5xx"] {
        let policy = policy(&format!(r#"{{"on": ["{on}"]}}"#));
        let rule = RetryRule::of(Some(&policy), 3);
        assert_eq!(
            rule.after_failure(&late(), &get()),
            Some(RetryReason::PerTryTimeout),
            "{on}"
        );
        assert_eq!(
            rule.after_failure(&late(), &post(false)),
            None,
            "{on}: POST"
        );
        assert_eq!(
            rule.after_failure(&late(), &post(true)),
            Some(RetryReason::PerTryTimeout),
            "{on}: POST with Idempotency-Key"
        );
        assert_eq!(rule.after_failure(&connect_failed(), &get()), None, "{on}");
    }
    let rule_policy = policy(r#"{"on": ["connect_failure"]}"#);
    let rule = RetryRule::of(Some(&rule_policy), 3);
    assert_eq!(rule.after_failure(&late(), &get()), None);
    let send_timeout = failure(UpstreamFailureKind::SendTimeout { timeout_ms: 1 });
    let all = policy(r#"{"on": ["per_try_timeout", "5xx", "reset"]}"#);
    assert_eq!(
        RetryRule::of(Some(&all), 3).after_failure(&send_timeout, &get()),
        None,
        "part of the body went"
    );
}

#[test]
fn an_answer_is_retried_only_when_the_request_is_safe_to_repeat() {
    let policy = policy(r#"{"on": ["gateway_error"]}"#);
    let rule = RetryRule::of(Some(&policy), 3);
    assert_eq!(status(&rule, 503, &post(false)), Err(NotRetried::Unsafe));
    assert!(status(&rule, 503, &post(true)).is_ok());
    for method in [
        Method::GET,
        Method::HEAD,
        Method::PUT,
        Method::DELETE,
        Method::OPTIONS,
    ] {
        let request = Resend {
            method: &method,
            body_repeatable: true,
            idempotency_key: false,
        };
        assert!(status(&rule, 503, &request).is_ok(), "{method}");
    }
    let streamed = Resend {
        method: &Method::GET,
        body_repeatable: false,
        idempotency_key: true,
    };
    assert_eq!(status(&rule, 503, &streamed), Err(NotRetried::Unsafe));
    assert_eq!(rule.after_failure(&connect_failed(), &streamed), None);
}

#[test]
fn grpc_statuses_count_only_for_grpc_requests() {
    let policy = policy(r#"{"on": ["unavailable", "deadline_exceeded"]}"#);
    let rule = RetryRule::of(Some(&policy), 3);
    let trailers_only = |grpc_status: &str| {
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", grpc_status.parse().unwrap());
        headers
    };
    let retried = |grpc_status: &str, grpc: bool| {
        rule.after_answer(
            StatusCode::OK,
            &trailers_only(grpc_status),
            grpc,
            &post(false),
        )
    };
    // gRPC requests are POSTs: an answer means the target may have acted.
    assert_eq!(retried("14", true), Err(NotRetried::Unsafe));
    let keyed = |grpc_status: &str, grpc: bool| {
        rule.after_answer(
            StatusCode::OK,
            &trailers_only(grpc_status),
            grpc,
            &post(true),
        )
    };
    assert_eq!(keyed("14", true).unwrap().reason, RetryReason::GrpcStatus);
    assert_eq!(keyed("4", true).unwrap().reason, RetryReason::GrpcStatus);
    assert_eq!(keyed("8", true), Err(NotRetried::NotNamed));
    assert_eq!(keyed("0", true), Err(NotRetried::NotNamed));
    assert_eq!(keyed("14", false), Err(NotRetried::NotNamed));
}

#[test]
fn retry_after_is_waited_for_up_to_the_backoff_cap() {
    let policy = policy(r#"{"on": ["gateway_error"], "backoff": {"base_ms": 10, "max_ms": 2000}}"#);
    let rule = RetryRule::of(Some(&policy), 3);
    let answer = |value: &str| {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::RETRY_AFTER, value.parse().unwrap());
        rule.after_answer(StatusCode::SERVICE_UNAVAILABLE, &headers, false, &get())
    };
    assert_eq!(
        answer("1").unwrap().retry_after,
        Some(Duration::from_secs(1))
    );
    assert_eq!(
        answer("2").unwrap().retry_after,
        Some(Duration::from_secs(2))
    );
    assert_eq!(answer("3"), Err(NotRetried::RetryAfterTooLong));
    assert_eq!(
        answer("soon").unwrap().retry_after,
        None,
        "unreadable: ignored"
    );
    let past = httpdate::fmt_http_date(std::time::UNIX_EPOCH + Duration::from_secs(1_000_000));
    assert_eq!(answer(&past).unwrap().retry_after, Some(Duration::ZERO));
    let later = std::time::UNIX_EPOCH
        + Duration::from_millis(crate::clock::unix_ms())
        + Duration::from_secs(3600);
    assert_eq!(
        answer(&httpdate::fmt_http_date(later)),
        Err(NotRetried::RetryAfterTooLong)
    );
}

#[test]
fn backoff_is_a_full_jitter_draw_under_an_exponential_cap() {
    let policy = policy(r#"{"backoff": {"base_ms": 25, "max_ms": 250}}"#);
    let rule = RetryRule::of(Some(&policy), 3);
    let steps: Vec<u64> = (1..=6)
        .map(|retry| rule.backoff(retry, |step| step).as_millis() as u64)
        .collect();
    assert_eq!(steps, [25, 50, 100, 200, 250, 250]);
    for retry in 1..=6 {
        assert_eq!(rule.backoff(retry, |_| 0), Duration::ZERO);
        assert_eq!(
            rule.backoff(retry, |step| step * 10),
            Duration::from_millis(steps[retry as usize - 1]),
            "a draw past the step is held to it"
        );
    }
    assert_eq!(
        rule.backoff(200, |step| step),
        Duration::from_millis(250),
        "no overflow"
    );
    // The real draw stays within the step and is not always the same.
    let draws: std::collections::BTreeSet<Duration> =
        (0..200).map(|_| rule.delay_before(3, None)).collect();
    assert!(draws.iter().all(|draw| *draw <= Duration::from_millis(100)));
    assert!(draws.len() > 10, "{draws:?}");
    assert_eq!(
        rule.delay_before(3, Some(Duration::from_millis(7))),
        Duration::from_millis(7)
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_waits_its_backoff_in_time() {
    let policy = policy(r#"{"backoff": {"base_ms": 1000, "max_ms": 1000}}"#);
    let rule = RetryRule::of(Some(&policy), 3);
    let started = tokio::time::Instant::now();
    tokio::time::sleep(rule.delay_before(1, None)).await;
    assert!(started.elapsed() <= Duration::from_millis(1000));
    let started = tokio::time::Instant::now();
    tokio::time::sleep(rule.delay_before(1, Some(Duration::from_millis(750)))).await;
    assert_eq!(started.elapsed(), Duration::from_millis(750));
}

#[test]
fn only_idempotent_requests_with_their_body_at_hand_are_hedged() {
    let policy = policy(r#"{"attempts": 2, "hedge_after_ms": 40}"#);
    let rule = RetryRule::of(Some(&policy), 3);
    assert_eq!(rule.hedges(&get()), Some(Duration::from_millis(40)));
    assert_eq!(rule.hedges(&post(true)), None, "two at once is not a retry");
    let streamed = Resend {
        method: &Method::PUT,
        body_repeatable: false,
        idempotency_key: false,
    };
    assert_eq!(rule.hedges(&streamed), None);
    let one = self::policy(r#"{"attempts": 1, "hedge_after_ms": 40}"#);
    assert_eq!(RetryRule::of(Some(&one), 3).hedges(&get()), None);
    assert_eq!(RetryRule::of(None, 3).hedges(&get()), None);
}
