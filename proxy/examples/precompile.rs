//! Writes a plugin compiled as the proxy compiles it (same engine
//! settings), as an ELF object with a symbol per function, for mapping a
//! profile of the proxy's JIT code back to the plugin's functions. Used by
//! `bench/guest-profile.sh`.
//!
//!   cargo run --release --example precompile -- PLUGIN.wasm OUT.cwasm

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [wasm, out] = args.as_slice() else {
        anyhow::bail!("usage: precompile PLUGIN.wasm OUT.cwasm");
    };
    let host = portcullis::plugin::host().map_err(anyhow::Error::msg)?;
    let compiled = host
        .precompile(&std::fs::read(wasm)?)
        .map_err(|e| anyhow::anyhow!("{e:#}"))?;
    std::fs::write(out, compiled)?;
    Ok(())
}
