// The smallest useful policy, in JavaScript: refuse requests that lack a
// header. The same plugin as examples/require-header (Rust) and
// require-header-py, built by componentize-js against wit/policy.wit (see
// build.sh). The world's exports are this module's exports, in camelCase;
// `host` is imported from its WIT name; a thrown string is the `err` of a
// `result`.

import { requestHeader, count } from 'portcullis:policy/host@0.3.0';

// The route's header, set once per instance by `configure`.
let header = '';

// The header name in a route's config; throws what is wrong (`portcullis
// check` prints it with the route).
function parse(config) {
  let c;
  try {
    c = JSON.parse(config);
  } catch (e) {
    throw `config is not JSON: ${e.message}`;
  }
  // The policy is YAML: an unquoted 123 or yes arrives as a number or a
  // boolean, which the author meant as text.
  if (typeof c?.header === 'number' || typeof c?.header === 'boolean') {
    throw `\`header\`: expected text, found ${JSON.stringify(c.header)} ` +
      '(YAML reads an unquoted number or true/false as such: quote the value)';
  }
  if (typeof c?.header !== 'string' || c.header === '') {
    throw '`header`: the name of the header to require';
  }
  return c.header.toLowerCase();
}

const utf8 = new TextEncoder();
const keep = { remove: [], set: [], add: [] };

// Only requests: the proxy skips onResponse.
export function hooks() {
  return { request: true, response: false };
}

export function validateConfig(config) {
  parse(config);
}

export function configure(config) {
  header = parse(config);
}

export function onRequest(body) {
  if (requestHeader(header) !== undefined) {
    return { tag: 'forward', val: { headers: keep } };
  }
  count('refused', 1n);
  return {
    tag: 'respond',
    val: {
      status: 403,
      headers: [{ name: 'content-type', value: utf8.encode('application/json') }],
      body: utf8.encode(JSON.stringify({ error: 'missing header' })),
    },
  };
}

// The world's other calls; the hooks above and the decisions in onRequest
// mean the proxy never makes them.
export function onCallout(outcome) {
  throw new Error('no callout was made');
}

export function onResponse(response) {
  return { tag: 'forward', val: keep };
}

export function onResponseBody(response, body) {
  return { tag: 'forward', val: { headers: keep } };
}
