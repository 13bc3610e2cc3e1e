//! The job secret: the 256-bit key every admission handshake proves knowledge of.

use core::fmt;

use crate::fabric::FabricError;

/// The environment variable a job secret is read from: 64 hexadecimal digits.
pub const JOB_SECRET_VAR: &str = "FAIRRING_JOB_SECRET";

/// A 256-bit secret shared by every rank of a job (and by nothing else).
///
/// Its `Debug` output never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret([u8; 32]);

impl JobSecret {
    /// A secret from its 32 bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> JobSecret {
        JobSecret(bytes)
    }

    /// A fresh secret from the operating system's random source, for rank 0 to
    /// generate and share with the others over a trusted channel.
    pub fn generate() -> Result<JobSecret, FabricError> {
        let mut bytes = [0; 32];
        getrandom::fill(&mut bytes).map_err(|e| {
            FabricError::io("reading the system random source", std::io::Error::other(e))
        })?;
        Ok(JobSecret(bytes))
    }

    /// Parses 64 hexadecimal digits (either case). `variable` names the source in
    /// the error.
    pub fn from_hex(variable: &'static str, text: &str) -> Result<JobSecret, FabricError> {
        let text = text.trim();
        let bad = |reason: String| FabricError::Config { variable, reason };
        if text.len() != 64 {
            return Err(bad(format!(
                "expected 64 hexadecimal digits (256 bits), found {} characters",
                text.len()
            )));
        }
        let mut bytes = [0; 32];
        for (i, pair) in text.as_bytes().chunks_exact(2).enumerate() {
            let digit = |c: u8| (c as char).to_digit(16);
            match (digit(pair[0]), digit(pair[1])) {
                (Some(hi), Some(lo)) => {
                    bytes[i] = u8::try_from(hi * 16 + lo).expect("two hex digits fit a byte");
                }
                _ => {
                    return Err(bad(format!(
                        "character {} is not a hexadecimal digit",
                        2 * i + 1
                    )));
                }
            }
        }
        Ok(JobSecret(bytes))
    }

    /// Reads [`JOB_SECRET_VAR`]; `Ok(None)` when it is not set.
    pub fn from_env() -> Result<Option<JobSecret>, FabricError> {
        match std::env::var(JOB_SECRET_VAR) {
            Ok(text) => JobSecret::from_hex(JOB_SECRET_VAR, &text).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(FabricError::Config {
                variable: JOB_SECRET_VAR,
                reason: "not valid UTF-8".into(),
            }),
        }
    }

    /// The secret as 64 lowercase hexadecimal digits, for sharing with other ranks.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The secret's bytes, for keying other authenticated channels of the same job
    /// (the engine's rendezvous store uses them).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_refusals() {
        let s = JobSecret::from_bytes(core::array::from_fn(|i| {
            u8::try_from(i).unwrap().wrapping_mul(37)
        }));
        assert_eq!(JobSecret::from_hex("X", &s.to_hex()).unwrap(), s);
        assert_eq!(
            JobSecret::from_hex("X", &s.to_hex().to_uppercase()).unwrap(),
            s
        );
        let short = JobSecret::from_hex("FAIRRING_JOB_SECRET", "abc").unwrap_err();
        assert!(short.to_string().contains("FAIRRING_JOB_SECRET"), "{short}");
        let mut text = s.to_hex();
        text.replace_range(10..11, "g");
        let err = JobSecret::from_hex("X", &text).unwrap_err().to_string();
        assert!(err.contains("character 11"), "{err}");
        assert_eq!(format!("{s:?}"), "JobSecret(..)");
        assert_ne!(
            JobSecret::generate().unwrap(),
            JobSecret::generate().unwrap()
        );
    }
}
