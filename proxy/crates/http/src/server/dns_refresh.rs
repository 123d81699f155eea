//! The server's task that keeps `dns: each_address` upstreams' addresses
//! current (the address book itself is [`crate::discovery`]).

use std::collections::HashMap;
use std::sync::Weak;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::Control;
use crate::discovery;

/// Looks up the hosts of `control`'s `each_address` upstreams, each at
/// its upstream's `dns_refresh`, and swaps in their new addresses; ends
/// with `stop`, or when the server is gone.
pub async fn refresh(control: Weak<Control>, stop: CancellationToken) {
    let mut last: HashMap<discovery::HostPort, Instant> = HashMap::new();
    loop {
        let tick = {
            let Some(control) = control.upgrade() else {
                return;
            };
            let config = control.pipeline().config().clone();
            let hosts = discovery::hosts(&config);
            control.addresses().retain(&hosts);
            last.retain(|hp, _| hosts.contains_key(hp));
            let now = Instant::now();
            let due: Vec<discovery::HostPort> = hosts
                .iter()
                .filter(|(hp, every)| last.get(*hp).is_none_or(|t| now - *t >= **every))
                .map(|(hp, _)| hp.clone())
                .collect();
            for hp in &due {
                last.insert(hp.clone(), now);
            }
            if !due.is_empty() && control.addresses().look_up(due, &config).await {
                control.refresh_addresses();
            }
            hosts.values().copied().min()
        };
        match tick {
            Some(tick) => tokio::select! {
                _ = tokio::time::sleep(tick) => {}
                _ = stop.cancelled() => return,
            },
            // Nothing to look up: asleep until a configuration is applied
            // (no timer ticking in every proxy without such upstreams).
            None => {
                let Some(control) = control.upgrade() else {
                    return;
                };
                // Not holding the server while asleep (a permit kept by
                // `notify_one` loses no wake-up).
                let applied = control.addresses().applied();
                drop(control);
                tokio::select! {
                    _ = applied.notified() => {}
                    _ = stop.cancelled() => return,
                }
            }
        }
    }
}
