//! When a certificate expires: its `notAfter`, read from the DER (webpki
//! checks validity but does not expose it), for the expiry metric an
//! operator alerts on before a renewal that failed becomes an outage.

use crate::der;

/// `notAfter` of the DER certificate `cert`, in seconds since the Unix
/// epoch; `None` when the bytes are not a certificate this reads.
pub fn not_after(cert: &[u8]) -> Option<i64> {
    // ... serialNumber, signature, issuer, validity { notBefore, notAfter }
    let tbs = der::tbs_fields(cert)?;
    let (_, rest) = der::element(tbs, 0x02)?; // serialNumber
    let (_, rest) = der::element(rest, 0x30)?; // signature
    let (_, rest) = der::element(rest, 0x30)?; // issuer
    let (validity, _) = der::element(rest, 0x30)?;
    let (_, rest) = der::any_element(validity)?; // notBefore
    let (tag, time) = (rest.first()?, der::any_element(rest)?.0);
    match tag {
        0x17 => parse_time(time, false), // UTCTime: YYMMDDHHMMSSZ
        0x18 => parse_time(time, true),  // GeneralizedTime: YYYYMMDDHHMMSSZ
        _ => None,
    }
}

fn parse_time(text: &[u8], four_digit_year: bool) -> Option<i64> {
    let digits = |range: std::ops::Range<usize>| -> Option<i64> {
        std::str::from_utf8(text.get(range)?).ok()?.parse().ok()
    };
    let (year, at) = if four_digit_year {
        (digits(0..4)?, 4)
    } else {
        // RFC 5280: YY >= 50 is 19YY, else 20YY.
        let yy = digits(0..2)?;
        (if yy >= 50 { 1900 + yy } else { 2000 + yy }, 2)
    };
    let month = digits(at..at + 2)?;
    let day = digits(at + 2..at + 4)?;
    let hour = digits(at + 4..at + 6)?;
    let minute = digits(at + 6..at + 8)?;
    let second = digits(at + 8..at + 10)?;
    if text.get(at + 10) != Some(&b'Z') || !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's
/// algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_expiring(year: i32, month: u8, day: u8) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["a.example".to_owned()]).unwrap();
        params.not_after = rcgen::date_time_ymd(year, month, day);
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn reads_not_after_in_both_time_forms() {
        // rcgen writes UTCTime up to 2049 and GeneralizedTime from 2050,
        // as RFC 5280 asks.
        assert_eq!(not_after(&cert_expiring(2027, 3, 1)), Some(1_803_859_200));
        assert_eq!(not_after(&cert_expiring(2051, 1, 1)), Some(2_556_144_000));
    }

    #[test]
    fn anything_else_is_none() {
        assert_eq!(not_after(b""), None);
        assert_eq!(not_after(b"\x30\x03\x02\x01\x00"), None);
        let mut cut = cert_expiring(2027, 3, 1);
        cut.truncate(60);
        assert_eq!(not_after(&cut), None);
    }

    #[test]
    fn civil_days() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
    }
}
