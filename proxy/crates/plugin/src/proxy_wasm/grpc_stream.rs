//! gRPC streams, as Envoy's proxy-wasm host offers them:
//! `proxy_grpc_stream` opens one to an upstream of the policies over
//! HTTP/2 (`POST /SERVICE/METHOD`, `te: trailers`, the filter's metadata,
//! no deadline), `proxy_grpc_send` sends a message on it (and with
//! `end_stream`, half-closes it), `proxy_grpc_close` half-closes it and
//! `proxy_grpc_cancel` resets it (no callback after). What comes back is
//! given to the root context as it comes, on the VM's worker:
//! `proxy_on_grpc_receive_initial_metadata` (map 4),
//! `proxy_on_grpc_receive` for each message (buffer 5),
//! `proxy_on_grpc_receive_trailing_metadata` (map 5), then
//! `proxy_on_grpc_close` with the status (`proxy_get_status` gives its
//! message). A stream ends with its VM (a reload, a restart).

use bytes::{Buf, Bytes, BytesMut};
use tokio::sync::mpsc::{Sender, channel};

use crate::stream_body::{NotQueued, StreamSender, stream_body};
use tokio::task::AbortHandle;
use wasmtime::{Caller, Linker};

use super::grpc::{INTERNAL_FAILURE, code, decode, frame, from_http, request};
use super::guest::{Status, read, write_u32};
use super::vm::{Export, Vm};
use super::{ProxyWasm, VmState};
use crate::PluginError;
use crate::seam::StreamEvent;

/// The largest message a stream's answer may carry (gRPC's default
/// receive limit is 4 MiB); a larger one fails the stream.
const MAX_MESSAGE: usize = 4 << 20;

/// The most a filter's messages may take while they wait for the
/// upstream to read them: past it the stream fails (status 8,
/// RESOURCE_EXHAUSTED), as a filter sending faster than its upstream
/// reads would otherwise grow the proxy's memory past the VM's cap.
pub const MAX_QUEUED: usize = 4 << 20;

/// What comes back on a stream and waits for its VM (a piece of a
/// message, the head, the trailers): past it, the upstream's answer
/// waits in HTTP/2 flow control rather than in the proxy's memory.
const EVENTS_WAITING: usize = 8;

/// Tells `event` on `events` from a host call, which cannot wait: at
/// once when there is room, else from a task.
fn tell(events: &Sender<StreamEvent>, event: StreamEvent) {
    if let Err(tokio::sync::mpsc::error::TrySendError::Full(event)) = events.try_send(event)
        && let Ok(runtime) = tokio::runtime::Handle::try_current()
    {
        let events = events.clone();
        runtime.spawn(async move {
            let _ = events.send(event).await;
        });
    }
}

/// An open stream of a VM.
pub struct Stream {
    /// Where the filter's messages go; `None` once it half-closed.
    sender: Option<StreamSender>,
    /// Where what comes back is told; kept to tell the stream's own
    /// failure (its queue over the bound).
    events: Sender<StreamEvent>,
    /// Whether it failed for its queue: its close is status 8.
    overflowed: bool,
    /// The task that drives it and delivers what comes back.
    task: AbortHandle,
    /// What came back and is not yet a whole message.
    partial: BytesMut,
}

impl Drop for Stream {
    fn drop(&mut self) {
        // A stream cancelled, closed by both sides, or its VM dropped: the
        // request to the upstream ends with it.
        self.task.abort();
    }
}

/// A VM's open streams, by token (from the count HTTP calls' come from).
#[derive(Default)]
pub struct Streams(Vec<(u32, Stream)>);

impl Streams {
    fn get_mut(&mut self, token: u32) -> Option<&mut Stream> {
        self.0.iter_mut().find(|(t, _)| *t == token).map(|(_, s)| s)
    }

    fn remove(&mut self, token: u32) -> Option<Stream> {
        let i = self.0.iter().position(|(t, _)| *t == token)?;
        Some(self.0.swap_remove(i).1)
    }

    /// Ends stream `token` with nothing more told: whether it was open.
    pub fn cancel(&mut self, token: u32) -> bool {
        self.remove(token).is_some()
    }

    /// Ends what the filter sends on stream `token`; what comes back is
    /// still told: whether it was open.
    pub fn half_close(&mut self, token: u32) -> bool {
        match self.get_mut(token) {
            Some(stream) => {
                stream.sender = None;
                true
            }
            None => false,
        }
    }
}

/// Adds `proxy_grpc_stream` and `proxy_grpc_send` to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    type C<'a> = Caller<'a, VmState>;
    linker.func_wrap(
        "env",
        "proxy_grpc_stream",
        |mut c: C<'_>,
         up_ptr: i32,
         up_len: i32,
         service_ptr: i32,
         service_len: i32,
         method_ptr: i32,
         method_len: i32,
         meta_ptr: i32,
         meta_len: i32,
         ret_token: i32|
         -> wasmtime::Result<i32> {
            let target = [(up_ptr, up_len), (service_ptr, service_len)];
            let target = (target, (method_ptr, method_len), (meta_ptr, meta_len));
            let callout = match request(&mut c, target, None)? {
                Ok(callout) => callout,
                Err(status) => return Ok(status),
            };
            let token = c.data_mut().take_token();
            let Some(stream) = open(c.data(), token, callout) else {
                return Ok(INTERNAL_FAILURE);
            };
            c.data_mut().streams.0.push((token, stream));
            write_u32(&mut c, ret_token, token)?;
            Ok(Status::Ok as i32)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_send",
        |mut c: C<'_>, token: i32, ptr: i32, len: i32, end_stream: i32| -> wasmtime::Result<i32> {
            let message = read(&mut c, ptr, len)?;
            let Some(stream) = c.data_mut().streams.get_mut(token as u32) else {
                return Ok(Status::NotFound as i32);
            };
            // Sent after a half-close: nowhere to go, as in Envoy, which
            // drops it; after its queue overflowed, it fails anyway.
            let sent = match &stream.sender {
                Some(sender) if !stream.overflowed => sender.send(frame(&message)),
                _ => Ok(()),
            };
            if let Err(NotQueued::Full { queued, max }) = sent {
                // Failed through its own events, so the filter is told
                // as of any failure, after this call; the sender stays
                // (dropped, it would end the request body as if whole).
                stream.overflowed = true;
                let why = format!(
                    "the stream's messages waiting for the upstream passed {max} bytes ({queued} queued)"
                );
                tell(&stream.events, StreamEvent::Failed {
                    timed_out: false,
                    why,
                });
            }
            if end_stream != 0 && !stream.overflowed {
                stream.sender = None;
            }
            Ok(Status::Ok as i32)
        },
    )?;
    Ok(())
}

/// Starts stream `token` of the VM `state` is, on its worker: `None`
/// where no upstream can be reached from (a `check`, which serves none).
fn open(state: &VmState, token: u32, callout: crate::seam::Callout) -> Option<Stream> {
    let home = state.home.clone();
    let filter = home.filter.upgrade()?;
    let callouts = filter.callouts()?;
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    let (sender, body) = stream_body(MAX_QUEUED);
    let (events, mut told) = channel(EVENTS_WAITING);
    let drive = callouts.stream(home.shard, callout, body, events.clone());
    let deliver = async move {
        while let Some(event) = told.recv().await {
            let Some(filter) = home.filter.upgrade() else {
                return;
            };
            filter.on_home(&home, |vm, filter| {
                let mut told = Told { vm, filter, token };
                told.event(event)
            });
        }
    };
    let task = runtime.spawn(async move {
        tokio::join!(drive, deliver);
    });
    Some(Stream {
        sender: Some(sender),
        events,
        overflowed: false,
        task: task.abort_handle(),
        partial: BytesMut::new(),
    })
}

/// A stream's VM being told what came back on it.
struct Told<'a> {
    vm: &'a mut Vm,
    filter: &'a ProxyWasm,
    token: u32,
}

impl Told<'_> {
    fn event(&mut self, event: StreamEvent) -> Result<(), PluginError> {
        // Cancelled, or closed already: nothing more is told.
        if self.vm.streams().get_mut(self.token).is_none() {
            return Ok(());
        }
        match event {
            // As Envoy's gRPC client: initial metadata first, whatever the
            // head is (none for a trailers-only answer, which is all
            // status), then a failed head's status.
            StreamEvent::Head { status, headers } => {
                if status == 200 && headers.contains_key("grpc-status") {
                    self.metadata(Export::GrpcInitialMetadata, &http::HeaderMap::new())?;
                    return self.trailers(headers);
                }
                self.metadata(Export::GrpcInitialMetadata, &headers)?;
                if status != 200 {
                    let why = format!("upstream answered HTTP {status}");
                    return self.fail(from_http(status), why);
                }
                Ok(())
            }
            StreamEvent::Data(data) => self.data(data),
            StreamEvent::Trailers(trailers) => self.trailers(trailers),
            StreamEvent::End => self.fail(code::INTERNAL, "the stream ended with no status".into()),
            StreamEvent::Failed {
                timed_out: true, ..
            } => self.fail(code::UNAVAILABLE, "upstream request timeout".into()),
            StreamEvent::Failed { why, .. } => {
                let overflowed = self
                    .vm
                    .streams()
                    .get_mut(self.token)
                    .is_some_and(|s| s.overflowed);
                match overflowed {
                    true => self.fail(code::RESOURCE_EXHAUSTED, why),
                    false => self.fail(code::UNAVAILABLE, why),
                }
            }
        }
    }

    /// Metadata (initial or trailing) to its callback.
    fn metadata(&mut self, export: Export, headers: &http::HeaderMap) -> Result<(), PluginError> {
        let mut call = self.vm.blank();
        let pairs = headers.iter().map(|(k, v)| {
            let v = v.as_bytes().to_vec();
            (k.as_str().as_bytes().to_vec(), v)
        });
        call.answer = Some((pairs.collect(), Bytes::new()));
        let count = headers.len() as i32;
        self.callback(export, count, call)
    }

    /// Each whole message `data` completes to `proxy_on_grpc_receive`.
    fn data(&mut self, data: Bytes) -> Result<(), PluginError> {
        if let Some(stream) = self.vm.streams().get_mut(self.token) {
            stream.partial.extend_from_slice(&data);
        }
        // The filter may cancel the stream as it reads a message.
        while let Some(stream) = self.vm.streams().get_mut(self.token) {
            let message = match next_message(&mut stream.partial) {
                Ok(Some(message)) => message,
                Ok(None) => return Ok(()),
                Err(why) => return self.fail(code::INTERNAL, why),
            };
            let mut call = self.vm.blank();
            let size = message.len() as i32;
            call.grpc = Some(Ok(message));
            self.callback(Export::GrpcReceive, size, call)?;
        }
        Ok(())
    }

    /// Trailing metadata to its callback, then the status they carry.
    fn trailers(&mut self, trailers: http::HeaderMap) -> Result<(), PluginError> {
        // Cancelled as it read the initial metadata: nothing more.
        if self.vm.streams().get_mut(self.token).is_none() {
            return Ok(());
        }
        self.metadata(Export::GrpcTrailingMetadata, &trailers)?;
        let status = trailers
            .get("grpc-status")
            .and_then(|s| std::str::from_utf8(s.as_bytes()).ok())
            .and_then(|s| s.trim().parse::<u32>().ok())
            .unwrap_or(code::UNKNOWN);
        let message = trailers
            .get("grpc-message")
            .map_or_else(String::new, |m| decode(m.as_bytes()));
        self.close(status, message)
    }

    /// A stream that failed (no status from the upstream), as Envoy's
    /// gRPC client ends one: empty trailing metadata, then the status.
    fn fail(&mut self, status: u32, message: String) -> Result<(), PluginError> {
        self.metadata(Export::GrpcTrailingMetadata, &http::HeaderMap::new())?;
        self.close(status, message)
    }

    /// The stream's end, with its status, to `proxy_on_grpc_close`.
    fn close(&mut self, status: u32, message: String) -> Result<(), PluginError> {
        if self.vm.streams().remove(self.token).is_none() {
            return Ok(());
        }
        let mut call = self.vm.blank();
        call.grpc = Some(Err((status, message)));
        self.callback(Export::GrpcClose, status as i32, call)
    }

    fn callback(
        &mut self,
        export: Export,
        last: i32,
        call: Box<super::Call>,
    ) -> Result<(), PluginError> {
        let (call, result) = self
            .vm
            .grpc_callback(self.filter, export, (self.token, last), call);
        self.vm.root_calls(call);
        result
    }
}

/// The next whole message in `partial`, taken from it; why the stream
/// cannot go on.
fn next_message(partial: &mut BytesMut) -> Result<Option<Bytes>, String> {
    let [compressed, a, b, c, d, ..] = partial.as_ref() else {
        return Ok(None);
    };
    if *compressed != 0 {
        return Err("a compressed message".into());
    }
    let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
    if len > MAX_MESSAGE {
        return Err(format!("a message over {MAX_MESSAGE} bytes"));
    }
    if partial.len() < 5 + len {
        return Ok(None);
    }
    partial.advance(5);
    Ok(Some(partial.split_to(len).freeze()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_cut_from_frames_as_they_complete() {
        let mut partial = BytesMut::new();
        partial.extend_from_slice(b"\0\0\0\0\x02h");
        assert_eq!(next_message(&mut partial), Ok(None));
        partial.extend_from_slice(b"i\0\0\0\0\0\0\0\0");
        assert_eq!(
            next_message(&mut partial),
            Ok(Some(Bytes::from_static(b"hi")))
        );
        assert_eq!(next_message(&mut partial), Ok(Some(Bytes::new())));
        assert_eq!(next_message(&mut partial), Ok(None));
        assert_eq!(&partial[..], b"\0\0\0");
        let mut compressed = BytesMut::from(&b"\x01\0\0\0\x01x"[..]);
        assert!(next_message(&mut compressed).is_err());
        let mut huge = BytesMut::from(&b"\0\xff\xff\xff\xff"[..]);
        assert!(next_message(&mut huge).is_err());
    }
}
