//! Durations (`500ms`, `10s`, `1m30s`) and byte sizes (`64KiB`, `1MB`, `4096`).

use std::time::Duration;

/// Parses a duration made of number-unit pairs: `ms`, `s`, `m`, `h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("`{s}` is not a duration; write it like 500ms, 10s, 1m30s or 2h");
    let s = s.trim();
    if s.is_empty() {
        return Err(bad());
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            _ => return Err(bad()),
        };
        total = total.saturating_add(part);
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// Parses a byte size: a plain number of bytes or one with a unit
/// (`KiB`/`MiB`/`GiB` are powers of 1024, `KB`/`MB`/`GB` of 1000).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bad = || format!("`{s}` is not a size; write it like 4096, 64KiB or 1MiB");
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if split == 0 {
        return Err(bad());
    }
    let n: u64 = s[..split].parse().map_err(|_| bad())?;
    let mult: u64 = match s[split..].trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

/// Parses a rate: `COUNT/s`, `/m` or `/h` (`10/s`, `600/m`).
pub fn parse_rate(s: &str) -> Result<(u32, Duration), String> {
    let bad = || format!("rate `{s}`: expected COUNT/s, COUNT/m or COUNT/h, such as `10/s`");
    let (count, unit) = s.trim().split_once('/').ok_or_else(bad)?;
    let count: u32 = count.trim().parse().map_err(|_| bad())?;
    if count == 0 {
        return Err(format!("rate `{s}`: the count must be at least 1"));
    }
    let period = match unit.trim() {
        "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        _ => return Err(bad()),
    };
    Ok((count, period))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        for bad in ["", "10", "s", "10x", "1.5s", "-1s"] {
            assert!(parse_duration(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1MB").unwrap(), 1_000_000);
        for bad in ["", "KiB", "12 parsecs", "99999999999999999999"] {
            assert!(parse_size(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn rates_parse_with_their_unit() {
        assert_eq!(parse_rate("10/s").unwrap(), (10, Duration::from_secs(1)));
        assert_eq!(
            parse_rate(" 600 / m ").unwrap(),
            (600, Duration::from_secs(60))
        );
        assert_eq!(parse_rate("1/h").unwrap(), (1, Duration::from_secs(3600)));
        assert!(parse_rate("10").unwrap_err().contains("COUNT/s"));
        assert!(parse_rate("10/d").is_err());
        assert!(parse_rate("0/s").unwrap_err().contains("at least 1"));
        assert!(parse_rate("-1/s").is_err());
    }
}
