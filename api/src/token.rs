//! BootstrapToken: a short-lived secret that lets a new machine enroll.
//!
//! The full token is `kst.<id>.<secret>`: a 6-character id (the resource's name) and a
//! 16-character secret. The controller stores only a hash of the secret and shows the whole
//! token once, when it is created.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::meta::{ObjectMeta, Timestamp};

pub const TOKEN_PREFIX: &str = "kst";
pub const TOKEN_ID_LEN: usize = 6;
pub const TOKEN_SECRET_LEN: usize = 16;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BootstrapToken {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: TokenSpec,
    #[serde(default)]
    pub status: TokenStatus,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenSpec {
    #[serde(default, skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    pub expires_at: Option<Timestamp>,
    /// How many enrollments the token allows; none means unlimited until it expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_limit: Option<u32>,
    /// Labels given to every machine that enrolls with this token.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Whether the token may enroll a name that already has an identity (a reinstalled machine).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_reenroll: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenStatus {
    #[serde(default)]
    pub usages: u32,
}

/// A parsed `kst.<id>.<secret>` token.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenString {
    pub id: String,
    pub secret: String,
}

// The secret must never reach a log line through Debug.
impl fmt::Debug for TokenString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenString {{ id: {:?}, secret: <redacted> }}", self.id)
    }
}

impl fmt::Display for TokenString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{TOKEN_PREFIX}.{}.{}", self.id, self.secret)
    }
}

impl FromStr for TokenString {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || "token is not of the form kst.<6 characters>.<16 characters>".to_owned();
        let mut parts = s.trim().split('.');
        let (Some(prefix), Some(id), Some(secret), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        let charset = |p: &str| p.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if prefix != TOKEN_PREFIX || id.len() != TOKEN_ID_LEN || secret.len() != TOKEN_SECRET_LEN || !charset(id) || !charset(secret) {
            return Err(bad());
        }
        Ok(TokenString { id: id.to_owned(), secret: secret.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_strings_parse_strictly() {
        let t: TokenString = "kst.abc123.0123456789abcdef".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.id, "abc123");
        assert_eq!(t.to_string(), "kst.abc123.0123456789abcdef");
        assert!(!format!("{t:?}").contains("0123456789abcdef"));
        for bad in [
            "",
            "kst.abc123",
            "kst.abc12.0123456789abcdef",
            "xyz.abc123.0123456789abcdef",
            "kst.ABC123.0123456789abcdef",
            "kst.abc123.0123456789abcdef.x",
        ] {
            assert!(bad.parse::<TokenString>().is_err(), "{bad}");
        }
    }
}
