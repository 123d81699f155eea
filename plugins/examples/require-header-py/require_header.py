"""The smallest useful policy, in Python: refuse requests that lack a header.

The same plugin as examples/require-header (Rust), built by componentize-py
against wit/policy.wit (see build.sh). The policy names it as any plugin:

    plugins: [{ name: require-header, path: example-require-header-py.wasm }]
    routes:
      - name: api
        match: { path_prefix: /api }
        upstream: api
        plugins: [{ use: require-header, config: { header: x-api-key }, timeout: 50ms }]

`componentize-py -d ../../../wit -w policy bindings .` writes the
`wit_world` package this imports, for an editor to read; the build makes
its own.
"""

import json

import wit_world
from componentize_py_types import Err
from wit_world.imports import host, types

# The route's header, set once per instance by `configure`.
HEADER = ""


def parse(config: str) -> str:
    """The header name in a route's config, or Err naming what is wrong
    (`portcullis check` prints it with the route)."""
    try:
        c = json.loads(config)
    except ValueError as e:
        raise Err(f"config is not JSON: {e}")
    header = c.get("header") if isinstance(c, dict) else None
    # The policy is YAML: an unquoted 123 or yes arrives as a number or a
    # boolean, which the author meant as text.
    if isinstance(header, (bool, int, float)):
        raise Err(f"`header`: expected text, found {json.dumps(header)} "
                  "(YAML reads an unquoted number or true/false as such: quote the value)")
    if not isinstance(header, str) or not header:
        raise Err("`header`: the name of the header to require")
    return header.lower()


class WitWorld(wit_world.WitWorld):
    def hooks(self) -> types.Hooks:
        # Only requests: the proxy skips on-response.
        return types.Hooks.REQUEST

    def validate_config(self, config: str) -> None:
        parse(config)

    def configure(self, config: str) -> None:
        global HEADER
        HEADER = parse(config)

    def on_request(self, body: bytes | None) -> types.Decision:
        if host.request_header(HEADER) is not None:
            keep = types.HeaderEdits(remove=[], set=[], add=[])
            return types.Decision_Forward(types.Forward(headers=keep, path=None, upstream=None))
        host.count("refused", 1)
        head = [types.Header(name="content-type", value=b"application/json")]
        body = json.dumps({"error": "missing header"}).encode()
        return types.Decision_Respond(types.LocalResponse(status=403, headers=head, body=body))

    # The world's other calls; the hooks above and the decisions in
    # on_request mean the proxy never makes them.
    def on_callout(self, outcome: types.CalloutResult) -> types.Decision:
        raise AssertionError("no callout was made")

    def on_response(self, response: types.ResponseHead) -> types.ResponseDecision:
        return types.ResponseDecision_Forward(types.HeaderEdits(remove=[], set=[], add=[]))

    def on_response_body(self, response: types.ResponseHead, body: bytes) -> types.ResponseBodyDecision:
        keep = types.ResponseEdits(headers=types.HeaderEdits(remove=[], set=[], add=[]), body=None)
        return types.ResponseBodyDecision_Forward(keep)
