//! A VM told the outcome of what it asked for: an HTTP call's answer
//! (`proxy_on_http_call_response`), a gRPC call's or stream's
//! (`proxy_on_grpc_*`), a Redis call's (Higress's
//! `proxy_on_redis_call_response`), each on the root context, as Envoy
//! (and Higress) call them; the SDKs find the context that asked.

use super::{Call, Export, ProxyWasm, Vm};
use crate::PluginError;

impl Vm {
    /// `proxy_on_http_call_response` for callout `token` (on the root
    /// context, as Envoy calls it; the SDKs find the HTTP context), lent
    /// `call` with the answer in it.
    pub fn http_call_response(
        &mut self,
        filter: &ProxyWasm,
        token: u32,
        call: Box<Call>,
    ) -> (Box<Call>, Result<(), PluginError>) {
        let (headers, body) = call
            .answer
            .as_ref()
            .map_or((0, 0), |(h, b)| (h.len() as i32, b.len() as i32));
        let args = [self.root(), token as i32, headers, body, 0];
        let (call, result) = self.with_call(call, |vm| {
            vm.call(filter, Export::HttpCallResponse, &args, 0)
        });
        (call, result.map(|_| ()))
    }

    /// A gRPC call's outcome, in `call.grpc`, for call `token`:
    /// `proxy_on_grpc_receive` with its message, or `proxy_on_grpc_close`
    /// with its status (on the root context, as for HTTP calls).
    pub fn grpc_outcome(
        &mut self,
        filter: &ProxyWasm,
        token: u32,
        call: Box<Call>,
    ) -> (Box<Call>, Result<(), PluginError>) {
        let (export, last) = match &call.grpc {
            Some(Ok(message)) => (Export::GrpcReceive, message.len() as i32),
            Some(Err((code, _))) => (Export::GrpcClose, *code as i32),
            None => return (call, Ok(())),
        };
        self.grpc_callback(filter, export, (token, last), call)
    }

    /// gRPC callback `export` (one of `proxy_on_grpc_*`) on the root
    /// context for `token` with `last` (a size, a count or a status),
    /// lent `call` (which holds what the callback reads); none if the
    /// filter does not export it.
    pub fn grpc_callback(
        &mut self,
        filter: &ProxyWasm,
        export: Export,
        (token, last): (u32, i32),
        call: Box<Call>,
    ) -> (Box<Call>, Result<(), PluginError>) {
        let args = [self.root(), token as i32, last];
        self.root_callback(filter, export, &args, call)
    }

    /// A Redis call's outcome for call `token` (Higress's
    /// `proxy_on_redis_call_response` on the root context): `status` 0
    /// with the reply in `call.answer`'s body, or non-zero with none.
    pub fn redis_response(
        &mut self,
        filter: &ProxyWasm,
        token: u32,
        status: i32,
        call: Box<Call>,
    ) -> (Box<Call>, Result<(), PluginError>) {
        let size = call
            .answer
            .as_ref()
            .map_or(0, |(_, body)| body.len() as i32);
        let args = [self.root(), token as i32, status, size];
        self.root_callback(filter, Export::RedisCallResponse, &args, call)
    }

    /// Callback `export` with `args` (the root context first), lent
    /// `call`; none if the filter does not export it.
    fn root_callback(
        &mut self,
        filter: &ProxyWasm,
        export: Export,
        args: &[i32],
        call: Box<Call>,
    ) -> (Box<Call>, Result<(), PluginError>) {
        if self.exports[export as usize].is_none() {
            return (call, Ok(()));
        }
        let (call, result) = self.with_call(call, |vm| vm.call(filter, export, args, 0));
        (call, result.map(|_| ()))
    }

    /// Whether `token` is a Redis call's (forgotten now).
    pub fn take_redis(&mut self, token: u32) -> bool {
        self.store.data_mut().redis.take(token)
    }

    /// Its gRPC streams open.
    pub fn streams(&mut self) -> &mut crate::proxy_wasm::grpc_stream::Streams {
        &mut self.store.data_mut().streams
    }

    /// Whether `token` is a gRPC call's (forgotten now): `Some(true)` for
    /// one the filter cancelled.
    pub fn take_grpc(&mut self, token: u32) -> Option<bool> {
        self.store.data_mut().grpc.take(token)
    }
}
