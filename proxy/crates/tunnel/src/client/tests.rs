use super::*;

#[test]
fn quic_is_tried_again_once_the_retry_period_has_passed() {
    let (s, ms) = (Duration::from_secs, Duration::from_millis);
    let ten_min = s(600);
    // Never fell back: always QUIC.
    assert!(quic_due(0, s(0), ten_min));
    // Fell back at 5 s: WebSocket until 605 s, then QUIC again.
    assert!(!quic_due(5_000, s(5), ten_min));
    assert!(!quic_due(5_000, ms(604_999), ten_min));
    assert!(quic_due(5_000, s(605), ten_min));
    // 0 s: every dial tries QUIC first.
    assert!(quic_due(5_000, s(5), s(0)));
}

#[test]
fn backoff_is_jittered_grows_to_the_cap_and_resets() {
    let mut b = Backoff::new();
    let first = b.next();
    assert!(
        first >= FIRST_DELAY / 2 && first <= FIRST_DELAY,
        "{first:?}"
    );
    let mut step = FIRST_DELAY;
    for _ in 0..12 {
        step = (step * 2).min(MAX_DELAY);
        let d = b.next();
        assert!(
            d >= step / 2 && d <= step,
            "{d:?} outside [{:?}, {step:?}]",
            step / 2
        );
    }
    assert_eq!(step, MAX_DELAY);
    b.reset();
    assert!(b.next() <= FIRST_DELAY);
    // Jitter: a handful of clients cut off together do not all wait
    // the same time.
    let spread: std::collections::HashSet<_> = (0..8).map(|_| Backoff::new().next()).collect();
    assert!(spread.len() > 1, "no jitter: {spread:?}");
}

#[test]
fn upstream_mode_policy_routes_everything_to_the_url_with_upgrades() {
    let source = upstream_policy("http://app:8080");
    let config = portcullis_config::load_sources(&[source], &|_| None)
        .expect("the generated policy is valid");
    assert_eq!(config.routes.len(), 1);
    assert!(config.routes[0].websocket);
    assert!(config.listeners.is_empty());
}
