//! The operator's credential file (`admin.conf`), read by the CLI and written by the controller
//! on first start: where the controller is, the CA to trust, and the client certificate.

use serde::{Deserialize, Serialize};

pub const KIND_CONFIG: &str = "Config";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConfig {
    pub api_version: String,
    pub kind: String,
    /// One or more controller URLs, tried in order.
    pub servers: Vec<String>,
    /// PEM CA certificate(s).
    pub certificate_authority: String,
    /// PEM client certificate.
    pub client_certificate: String,
    /// PEM private key of the client certificate.
    pub client_key: String,
}

impl ClientConfig {
    pub fn new(servers: Vec<String>, certificate_authority: String, client_certificate: String, client_key: String) -> Self {
        ClientConfig {
            api_version: crate::API_VERSION.to_owned(),
            kind: KIND_CONFIG.to_owned(),
            servers,
            certificate_authority,
            client_certificate,
            client_key,
        }
    }

    pub fn from_yaml(text: &str) -> Result<Self, String> {
        let config: ClientConfig = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
        if config.kind != KIND_CONFIG {
            return Err(format!("kind: {:?} where \"Config\" was expected", config.kind));
        }
        if config.servers.is_empty() {
            return Err("servers: needs at least one controller URL".into());
        }
        Ok(config)
    }

    pub fn to_yaml(&self) -> String {
        serde_saphyr::to_string(self).unwrap_or_else(|e| panic!("serialising a client config: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_yaml_with_pem_blocks() {
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\nAAAA\n-----END CERTIFICATE-----\n";
        let c = ClientConfig::new(vec!["https://127.0.0.1:9443".into()], pem.into(), pem.into(), pem.into());
        let back = ClientConfig::from_yaml(&c.to_yaml()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, c);
    }
}
