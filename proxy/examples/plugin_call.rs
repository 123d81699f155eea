//! Times one plugin call in isolation: the request hooks of every route of a
//! policy directory that has plugins, called back to back on one thread
//! with a request carrying the given headers, as the proxy calls them.
//!
//!   cargo run --release --example plugin_call -- POLICY_DIR [CALLS] [name:value ...]
//!
//! Prints, per route, the per-call time at p50/p99 and the mean, and what
//! the plugin decided. `bench/plugins.sh` runs it beside the wrk figures.

use std::time::Instant;

use portcullis::plugin::{self, RequestFacts, Verdict};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: plugin_call POLICY_DIR [CALLS] [name:value ...]"))?;
    let calls: usize = args.next().map_or(Ok(200_000), |n| n.parse())?;
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::HOST, "bench.example".parse()?);
    for h in args {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| anyhow::anyhow!("header `{h}` is not name:value"))?;
        headers.append(
            http::HeaderName::from_bytes(name.trim().as_bytes())?,
            value.trim().parse()?,
        );
    }
    let config = portcullis::config::load_dir(std::path::Path::new(&dir))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let chains = plugin::prepare(&config)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        println!(
            "{:<10} {:>10} {:>10} {:>10}  decision",
            "route", "p50 (us)", "p99 (us)", "mean (us)"
        );
        for (index, (route, chain)) in config.routes.iter().zip(&chains.routes).enumerate() {
            let Some(binding) = chain.first() else {
                continue;
            };
            let uri: http::Uri = format!("/{}", route.name).parse()?;
            let client = "127.0.0.1".parse()?;
            let mut times = Vec::with_capacity(calls);
            let mut decision = String::new();
            for i in 0..calls + calls / 10 {
                let start = Instant::now();
                // What the chain builds per request, timed with the call.
                let mut facts = Some(RequestFacts {
                    method: http::Method::GET,
                    uri: uri.clone(),
                    normalized: None,
                    rewritten: None,
                    client,
                    tls: false,
                    sni: None,
                    client_cert: None,
                    route: index,
                    params: Vec::new(),
                    bodiless: true,
                });
                let mut stream = plugin::Stream::NONE;
                let d = binding.on_request(&mut stream, &mut facts, &mut headers, None);
                // A proxy-wasm filter's context ends with its request.
                if stream != plugin::Stream::NONE {
                    binding.end(stream);
                }
                let took = start.elapsed();
                // The first tenth warms caches and instances up.
                if i >= calls / 10 {
                    times.push(took.as_nanos() as u64);
                }
                if i == 0 {
                    decision = match d {
                        Ok(Verdict::Continue(_)) => "forward".into(),
                        Ok(Verdict::Respond(r)) => format!("respond {}", r.status),
                        Ok(Verdict::ReadBody(n)) => format!("read-body {n}"),
                        Ok(Verdict::Callout(c)) => format!("callout to {}", c.upstream),
                        Ok(Verdict::Noted(n)) => format!("forward, noted {}", n.what),
                        Err(e) => format!("error: {e}"),
                    };
                }
            }
            times.sort_unstable();
            let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
            let mean = times.iter().sum::<u64>() as f64 / times.len() as f64;
            println!(
                "{:<10} {:>10.2} {:>10.2} {:>10.2}  {decision}",
                route.name,
                at(0.5) as f64 / 1e3,
                at(0.99) as f64 / 1e3,
                mean / 1e3
            );
        }
        Ok(())
    })
}
