//! Parsing of knob values: every refusal names the variable and the value.

use std::time::Duration;

use crate::error::{Error, Result};

/// A non-negative integer that fits `u32`.
pub(crate) fn parse_u32(variable: &'static str, text: &str) -> Result<u32> {
    let value = parse_u64(variable, text)?;
    u32::try_from(value).map_err(|_| {
        Error::config(
            variable,
            text,
            format!("{value} is larger than {}", u32::MAX),
        )
    })
}

/// A non-negative decimal integer.
pub(crate) fn parse_u64(variable: &'static str, text: &str) -> Result<u64> {
    let t = text.trim();
    if t.is_empty() {
        return Err(Error::config(variable, text, "empty; expected a number"));
    }
    if t.starts_with('-') {
        return Err(Error::config(variable, text, "must not be negative"));
    }
    if !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::config(
            variable,
            text,
            "expected a non-negative decimal integer",
        ));
    }
    t.parse::<u64>()
        .map_err(|_| Error::config(variable, text, "too large"))
}

/// A byte count: an integer with an optional binary suffix (`K`/`KiB`, `M`/`MiB`,
/// `G`/`GiB`, any case).
pub(crate) fn parse_bytes(variable: &'static str, text: &str) -> Result<u64> {
    let t = text.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (number, suffix) = t.split_at(digits);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => {
            return Err(Error::config(
                variable,
                text,
                "expected a byte count: digits with an optional K, M or G (binary) suffix",
            ));
        }
    };
    let n = parse_u64(variable, number).map_err(|_| {
        Error::config(
            variable,
            text,
            "expected a byte count: digits with an optional K, M or G (binary) suffix",
        )
    })?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| Error::config(variable, text, "too large"))
}

/// A duration: seconds as a decimal number, or a number with an `ms`, `s` or `min`
/// suffix. Must be positive and at most a day.
pub(crate) fn parse_duration(variable: &'static str, text: &str) -> Result<Duration> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    let scale = match suffix.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "min" => 60.0,
        _ => {
            return Err(Error::config(
                variable,
                text,
                "expected seconds, or a number with an ms, s or min suffix",
            ));
        }
    };
    let value: f64 = number
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite())
        .ok_or_else(|| Error::config(variable, text, "expected a non-negative number"))?;
    let seconds = value * scale;
    if seconds <= 0.0 {
        return Err(Error::config(variable, text, "must be positive"));
    }
    if seconds > 86_400.0 {
        return Err(Error::config(variable, text, "must be at most a day"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused<T: std::fmt::Debug>(r: Result<T>, variable: &str) {
        match r {
            Err(Error::Config { variable: v, .. }) => assert_eq!(v, variable),
            other => panic!("expected a config error for {variable}, got {other:?}"),
        }
    }

    #[test]
    fn integers() {
        assert_eq!(parse_u32("X", " 7 ").unwrap(), 7);
        for bad in ["abc", "-1", "4294967296", "", "1.5", "0x10"] {
            refused(parse_u32("X", bad), "X");
        }
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("B", "4096").unwrap(), 4096);
        assert_eq!(parse_bytes("B", "25MiB").unwrap(), 25 << 20);
        assert_eq!(parse_bytes("B", "2 g").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("B", "64K").unwrap(), 64 << 10);
        for bad in ["abc", "-1", "1.5M", "10 TB", "18446744073709551615G", "M"] {
            refused(parse_bytes("B", bad), "B");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("T", "30").unwrap(), Duration::from_secs(30));
        assert_eq!(
            parse_duration("T", "250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            parse_duration("T", "1.5").unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(
            parse_duration("T", "2min").unwrap(),
            Duration::from_secs(120)
        );
        for bad in ["abc", "-1", "0", "4294967296", "1h", "nan", ""] {
            refused(parse_duration("T", bad), "T");
        }
    }
}
