//! The framing against tungstenite as the other end, over loopback TCP.

use super::*;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role as PeerRole};

/// A connected pair: ours as `role`, tungstenite as the other end.
async fn pair(role: Role) -> (WsIo<TcpStream>, WebSocketStream<TcpStream>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dialled = TcpStream::connect(listener.local_addr().unwrap());
    let (dialled, accepted) = tokio::join!(dialled, listener.accept());
    let (dialled, (accepted, _)) = (dialled.unwrap(), accepted.unwrap());
    let (ours, theirs, peer_role) = match role {
        Role::Client => (dialled, accepted, PeerRole::Server),
        Role::Server => (accepted, dialled, PeerRole::Client),
    };
    let peer = WebSocketStream::from_raw_socket(theirs, peer_role, None).await;
    (WsIo::new(ours, role, Vec::new()), peer)
}

/// Bytes long enough to need each length encoding, not repeating in step
/// with a mask.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[tokio::test]
async fn writes_arrive_as_binary_messages_from_either_end() {
    for role in [Role::Client, Role::Server] {
        let (mut ours, mut peer) = pair(role).await;
        let sizes = [1, 125, 126, 65_535, 65_536, 200_000];
        let writer = async {
            for n in sizes {
                ours.write_all(&pattern(n)).await.unwrap();
            }
            ours.flush().await.unwrap();
            ours
        };
        let reader = async {
            let mut got = Vec::new();
            let want: usize = sizes.iter().sum();
            while got.len() < want {
                match peer.next().await.unwrap().unwrap() {
                    Message::Binary(data) => got.extend_from_slice(&data),
                    other => panic!("{role:?}: not binary: {other:?}"),
                }
            }
            got
        };
        let (_, got) = tokio::join!(writer, reader);
        let want: Vec<u8> = sizes.iter().flat_map(|&n| pattern(n)).collect();
        assert_eq!(got, want, "{role:?}");
    }
}

#[tokio::test]
async fn reads_join_messages_and_fragments_straight_into_the_buffer() {
    for role in [Role::Client, Role::Server] {
        let (mut ours, mut peer) = pair(role).await;
        let sizes = [0, 1, 125, 126, 65_535, 65_536, 300_000];
        let mut want: Vec<u8> = sizes.iter().flat_map(|&n| pattern(n)).collect();
        let sender = async {
            for n in sizes {
                peer.send(Message::Binary(pattern(n).into())).await.unwrap();
            }
            // One message in three fragments.
            for (op, fin, part) in [
                (OpCode::Data(Data::Binary), false, &b"abc"[..]),
                (OpCode::Data(Data::Continue), false, &b""[..]),
                (OpCode::Data(Data::Continue), true, &b"defgh"[..]),
            ] {
                let header = FrameHeader {
                    is_final: fin,
                    opcode: op,
                    ..FrameHeader::default()
                };
                let frame = Frame::from_payload(header, part.to_vec().into());
                peer.send(Message::Frame(frame)).await.unwrap();
            }
            peer
        };
        want.extend_from_slice(b"abcdefgh");
        let reader = async {
            let mut got = vec![0u8; want.len()];
            ours.read_exact(&mut got).await.unwrap();
            got
        };
        let (_peer, got) = tokio::join!(sender, reader);
        assert_eq!(got, want, "{role:?}");
    }
}

#[tokio::test]
async fn a_ping_is_answered_and_a_close_ends_the_stream_and_is_answered() {
    for role in [Role::Client, Role::Server] {
        let (mut ours, mut peer) = pair(role).await;
        peer.send(Message::Ping(b"are you there".to_vec().into()))
            .await
            .unwrap();
        peer.send(Message::Binary(b"data".to_vec().into()))
            .await
            .unwrap();
        let mut got = [0u8; 4];
        ours.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"data");
        // tungstenite hands pongs up as messages.
        match peer.next().await.unwrap().unwrap() {
            Message::Pong(payload) => assert_eq!(&payload[..], b"are you there", "{role:?}"),
            other => panic!("{role:?}: no pong but {other:?}"),
        }
        let close = CloseFrame {
            code: 1001.into(),
            reason: "going away".into(),
        };
        peer.send(Message::Close(Some(close))).await.unwrap();
        let mut rest = Vec::new();
        assert_eq!(ours.read_to_end(&mut rest).await.unwrap(), 0, "{role:?}");
        match peer.next().await.unwrap().unwrap() {
            Message::Close(Some(frame)) => assert_eq!(u16::from(frame.code), 1001),
            other => panic!("{role:?}: no close answer but {other:?}"),
        }
    }
}

#[tokio::test]
async fn shutting_down_sends_a_normal_close() {
    let (mut ours, mut peer) = pair(Role::Client).await;
    ours.write_all(b"last").await.unwrap();
    ours.shutdown().await.unwrap();
    assert_eq!(
        peer.next().await.unwrap().unwrap(),
        Message::Binary(b"last".to_vec().into())
    );
    match peer.next().await.unwrap().unwrap() {
        Message::Close(Some(frame)) => assert_eq!(u16::from(frame.code), 1000),
        other => panic!("no close but {other:?}"),
    }
}

#[tokio::test]
async fn bytes_read_with_the_handshake_come_first() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dialled = TcpStream::connect(listener.local_addr().unwrap());
    let (dialled, accepted) = tokio::join!(dialled, listener.accept());
    let mut peer = accepted.unwrap().0;
    // A whole frame and the start of the next, as a handshake's read may
    // have taken them with the head; the rest comes on the stream.
    let carried = vec![0x82, 3, b'o', b'n', b'e', 0x82, 3, b't'];
    let mut ours = WsIo::new(dialled.unwrap(), Role::Client, carried);
    peer.write_all(b"wo").await.unwrap();
    let mut got = [0u8; 6];
    ours.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"onetwo");
}

#[tokio::test]
async fn protocol_errors_are_refused_by_name() {
    let cases: [(Role, &[u8], &str); 5] = [
        (Role::Server, &[0x82, 0x01, b'x'], "not masked"),
        (Role::Client, &[0x82, 0x81, 1, 2, 3, 4, b'x'], "is masked"),
        (Role::Client, &[0x81, 0x01, b'x'], "text frame"),
        (Role::Client, &[0xC2, 0x01, b'x'], "reserved bits"),
        (Role::Client, &[0x09, 0x00], "control frame fragmented"),
    ];
    for (role, bytes, what) in cases {
        let mut ours = WsIo::new(tokio::io::empty(), role, bytes.to_vec());
        let mut buf = [0u8; 8];
        let err = ours.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains(what), "{err} lacks {what}");
    }
    // A stream that ends within a frame is cut, not ended.
    let mut ours = WsIo::new(tokio::io::empty(), Role::Client, vec![0x82, 5, b'a']);
    let mut buf = [0u8; 8];
    assert_eq!(ours.read(&mut buf).await.unwrap(), 1);
    let err = ours.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    // Between frames, it is the end.
    let mut ours = WsIo::new(tokio::io::empty(), Role::Client, vec![0x82, 1, b'a']);
    let mut all = Vec::new();
    ours.read_to_end(&mut all).await.unwrap();
    assert_eq!(all, b"a");
}

#[test]
fn masking_at_any_offset_matches_byte_by_byte() {
    let mask = [0x12, 0x34, 0x56, 0x78];
    for at in 0..4 {
        for len in [0, 1, 7, 8, 9, 31] {
            let mut fast = pattern(len);
            let next = apply_mask(&mut fast, mask, at);
            let slow: Vec<u8> = pattern(len)
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ mask[(at + i) % 4])
                .collect();
            assert_eq!(fast, slow, "at {at}, {len} bytes");
            assert_eq!(next, (at + len) % 4);
        }
    }
}
