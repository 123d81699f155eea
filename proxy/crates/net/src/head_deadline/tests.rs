use super::*;
use tokio::time::{Instant, sleep};

const LIMIT: Duration = Duration::from_secs(10);

#[tokio::test(start_paused = true)]
async fn a_connection_without_a_request_is_dropped_at_the_deadline() {
    let clock = HeadClock::default();
    let never = std::future::pending::<()>();
    let start = Instant::now();
    assert_eq!(within(never, &clock, LIMIT).await, None);
    assert_eq!(start.elapsed(), LIMIT);
}

#[tokio::test(start_paused = true)]
async fn an_idle_kept_alive_connection_lives_past_the_deadline() {
    let clock = HeadClock::default();
    let served = async {
        clock.request(Version::HTTP_11);
        clock.response_done();
        sleep(Duration::from_secs(60)).await;
    };
    assert_eq!(within(served, &clock, LIMIT).await, Some(()));
}

#[tokio::test(start_paused = true)]
async fn a_later_head_that_stalls_is_dropped_a_limit_after_its_first_byte() {
    let clock = HeadClock::default();
    let start = Instant::now();
    let served = async {
        clock.request(Version::HTTP_11);
        sleep(Duration::from_secs(3)).await;
        clock.response_done();
        sleep(Duration::from_secs(40)).await;
        clock.bytes_read();
        std::future::pending::<()>().await;
    };
    assert_eq!(within(served, &clock, LIMIT).await, None);
    assert_eq!(start.elapsed(), Duration::from_secs(43) + LIMIT);
}

#[tokio::test(start_paused = true)]
async fn a_later_head_that_completes_in_time_is_not_cut() {
    let clock = HeadClock::default();
    let served = async {
        for _ in 0..3 {
            clock.request(Version::HTTP_11);
            clock.response_done();
            clock.bytes_read();
            sleep(LIMIT - Duration::from_secs(1)).await;
        }
        clock.request(Version::HTTP_11);
        sleep(Duration::from_secs(60)).await;
    };
    assert_eq!(within(served, &clock, LIMIT).await, Some(()));
}

#[tokio::test(start_paused = true)]
async fn a_head_started_in_the_poll_that_ended_another_gets_its_own_deadline() {
    let clock = HeadClock::default();
    let start = Instant::now();
    let served = async {
        clock.request(Version::HTTP_11);
        clock.response_done();
        clock.bytes_read();
        sleep(LIMIT - Duration::from_secs(1)).await;
        // In one poll: that head completes, its response is sent and
        // the next head starts.
        clock.request(Version::HTTP_11);
        clock.response_done();
        clock.bytes_read();
        std::future::pending::<()>().await;
    };
    assert_eq!(within(served, &clock, LIMIT).await, None);
    assert_eq!(start.elapsed(), LIMIT - Duration::from_secs(1) + LIMIT);
}

#[tokio::test(start_paused = true)]
async fn http2_connections_are_not_timed_after_their_first_request() {
    let clock = HeadClock::default();
    let served = async {
        clock.request(Version::HTTP_2);
        clock.response_done();
        // A ping or a window update between requests.
        clock.bytes_read();
        sleep(Duration::from_secs(60)).await;
    };
    assert_eq!(within(served, &clock, LIMIT).await, Some(()));
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_ends_first_gives_its_output() {
    let clock = HeadClock::default();
    assert_eq!(within(async { 7 }, &clock, LIMIT).await, Some(7));
}

#[tokio::test]
async fn the_socket_and_the_body_move_the_clock() {
    use tokio::io::AsyncWriteExt;

    let clock = Arc::new(HeadClock::default());
    clock.request(Version::HTTP_11);
    let ended = Ended::new(clock.clone());
    clock.bytes_read();
    assert_eq!(clock.awaited(), None, "busy: bytes read are the body");
    drop(ended);
    assert_eq!(clock.awaited(), None, "idle, no byte yet");
    let (mut client, server) = tokio::io::duplex(64);
    let mut watched = Watched::new(server, clock.clone());
    client.write_all(b"GET").await.unwrap();
    let mut buf = [0u8; 8];
    let n = tokio::io::AsyncReadExt::read(&mut watched, &mut buf)
        .await
        .unwrap();
    assert_eq!(&buf[..n], b"GET");
    assert!(clock.awaited().is_some(), "a head has started");
}

#[tokio::test]
async fn a_read_into_a_grown_buffer_marks_the_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let clock = Arc::new(HeadClock::default());
    let (mut client, server) = tokio::io::duplex(1024);
    let mut watched = Watched::new(server, clock.clone());
    client.write_all(b"abcd").await.unwrap();
    let mut small = vec![0u8; GROWN];
    assert_eq!(watched.read(&mut small).await.unwrap(), 4);
    assert!(!clock.grown(), "a buffer of {GROWN} bytes is not grown");
    client.write_all(b"efgh").await.unwrap();
    let mut large = vec![0u8; GROWN + 1];
    assert_eq!(watched.read(&mut large).await.unwrap(), 4);
    assert!(clock.grown());
}

#[tokio::test]
async fn only_what_hyper_writes_between_requests_is_replaced() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const BARE: &[u8] = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 23 Nov 2026 21:15:38 GMT\r\n\r\n";
    let clock = Arc::new(HeadClock::default());
    let (mut client, server) = tokio::io::duplex(4096);
    let mut watched = Watched::new(server, clock.clone());
    // A service's own bare 400, written while it is served and in the
    // write that follows its end, goes out as it is.
    clock.request(Version::HTTP_11);
    watched.write_all(BARE).await.unwrap();
    drop(Ended::new(clock.clone()));
    watched.write_all(BARE).await.unwrap();
    assert_eq!(clock.refused(), 0);
    // Once flushed, a bare 400 can only be hyper's: replaced.
    watched.flush().await.unwrap();
    watched.write_all(BARE).await.unwrap();
    watched.shutdown().await.unwrap();
    assert_eq!(clock.refused(), 400);
    let mut out = Vec::new();
    client.read_to_end(&mut out).await.unwrap();
    let out = String::from_utf8(out).unwrap();
    let bare = std::str::from_utf8(BARE).unwrap();
    let (kept, replaced) = out.split_at(2 * BARE.len());
    assert_eq!(kept, bare.repeat(2));
    assert!(
        replaced.ends_with(r#"{"error":"malformed request head","status":400,"route":null}"#),
        "{replaced}"
    );
}

#[tokio::test]
async fn the_deadline_holds_the_connection_once() {
    // An idle connection's task is mostly this value: a copy of the
    // connection beside the one polled would double it.
    let clock = HeadClock::default();
    let served = std::future::ready([7u8; 4096]);
    let size = std::mem::size_of_val(&served);
    let timed = within(served, &clock, LIMIT);
    let held = std::mem::size_of_val(&timed);
    assert!(
        held < size + 512,
        "{held} bytes for a {size}-byte connection"
    );
    assert_eq!(timed.await.map(|b| b[4095]), Some(7));
}
