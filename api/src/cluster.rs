//! The KubernetesCluster resource: a workload cluster whose nodes are keelson machines. The
//! controller keeps the cluster's kubeconfig so that it, and only it, can cordon and drain
//! those nodes (DESIGN.md, "Kubernetes nodes"). The kubeconfig is write-only: no answer
//! carries it, and no agent ever receives it.
//!
//! Only what a controller running as a service can use is accepted: the server's CA and the
//! credentials embedded in the kubeconfig (as `kubectl config view --raw --flatten` writes
//! them), a bearer token or a client certificate. File paths, exec plugins and auth
//! providers name things on the machine that wrote the kubeconfig, so they are refused
//! with a message that says so.

use base64::Engine;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

use crate::meta::ObjectMeta;
use crate::validate::ValidationError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubernetesCluster {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: ClusterSpec,
    #[serde(default)]
    pub status: ClusterStatus,
}

#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterSpec {
    /// The kubeconfig (YAML or JSON) with its CA and credentials embedded. Write-only.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kubeconfig: String,
    /// The kubeconfig context to use; its `current-context` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
}

/// Never prints the kubeconfig: it holds credentials.
impl std::fmt::Debug for ClusterSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSpec")
            .field("kubeconfig", &format_args!("({} bytes)", self.kubeconfig.len()))
            .field("context", &self.context)
            .finish()
    }
}

/// What the controller read from the kubeconfig, for operators: where it points and how it
/// signs in, never the secret itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `token` or `client certificate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// The API server's version as the controller last read it (`GET /version`), which the
    /// version skew policy holds kubelets to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<crate::version::KubeVersion>,
}

/// How the controller signs in to the API server.
#[derive(Clone, PartialEq, Eq)]
pub enum Credential {
    Token(String),
    ClientCertificate { cert_pem: Vec<u8>, key_pem: Vec<u8> },
}

impl Credential {
    pub fn describe(&self) -> &'static str {
        match self {
            Credential::Token(_) => "token",
            Credential::ClientCertificate { .. } => "client certificate",
        }
    }
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

/// A cluster's API server and how to reach it, read from a kubeconfig.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterAccess {
    pub server: String,
    /// The CA certificate(s) the server's certificate must chain to, PEM.
    pub ca_pem: Vec<u8>,
    pub credential: Credential,
    pub context: String,
    pub user: String,
}

impl ClusterAccess {
    pub fn status(&self) -> ClusterStatus {
        ClusterStatus {
            server: Some(self.server.clone()),
            context: Some(self.context.clone()),
            user: Some(self.user.clone()),
            credential: Some(self.credential.describe().to_owned()),
            server_version: None,
        }
    }
}

// What keelson reads of a kubeconfig; every other field is ignored, as kubectl does.
#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Kubeconfig {
    #[serde(default)]
    clusters: Vec<NamedCluster>,
    #[serde(default)]
    contexts: Vec<NamedContext>,
    #[serde(default)]
    users: Vec<NamedUser>,
    #[serde(default)]
    current_context: Option<String>,
}

#[derive(Deserialize)]
struct NamedCluster {
    name: String,
    cluster: ClusterEntry,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct ClusterEntry {
    #[serde(default)]
    server: String,
    #[serde(default)]
    certificate_authority_data: Option<String>,
    #[serde(default)]
    certificate_authority: Option<String>,
    #[serde(default)]
    insecure_skip_tls_verify: bool,
    #[serde(default)]
    proxy_url: Option<String>,
}

#[derive(Deserialize)]
struct NamedContext {
    name: String,
    context: ContextEntry,
}

#[derive(Deserialize)]
struct ContextEntry {
    cluster: String,
    user: String,
}

#[derive(Deserialize)]
struct NamedUser {
    name: String,
    user: UserEntry,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct UserEntry {
    #[serde(default)]
    token: Option<String>,
    #[serde(default, rename = "tokenFile")]
    token_file: Option<String>,
    #[serde(default)]
    client_certificate_data: Option<String>,
    #[serde(default)]
    client_key_data: Option<String>,
    #[serde(default)]
    client_certificate: Option<String>,
    #[serde(default)]
    client_key: Option<String>,
    #[serde(default)]
    exec: Option<IgnoredAny>,
    #[serde(default)]
    auth_provider: Option<IgnoredAny>,
    #[serde(default)]
    username: Option<String>,
}

const FIELD: &str = "spec.kubeconfig";
const FLATTEN: &str = "embed it (kubectl config view --raw --flatten)";

fn decode_data(what: &str, data: &str) -> Result<Vec<u8>, ValidationError> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| ValidationError::single(FIELD, format!("{what} is not base64: {e}")))?;
    if !bytes.starts_with(b"-----BEGIN ") {
        return Err(ValidationError::single(FIELD, format!("{what} does not hold a PEM block")));
    }
    Ok(bytes)
}

/// Reads the API server, CA and credential of `context` (the kubeconfig's current context
/// when `None`) from a kubeconfig; every refusal names `spec.kubeconfig` and says why.
pub fn read_kubeconfig(text: &str, context: Option<&str>) -> Result<ClusterAccess, ValidationError> {
    let bad = |message: String| ValidationError::single(FIELD, message);
    if text.trim().is_empty() {
        return Err(bad("is required".into()));
    }
    let config: Kubeconfig = serde_saphyr::from_str(text).map_err(|e| bad(format!("not a kubeconfig: {e}")))?;
    let context_name = match context.or(config.current_context.as_deref()).filter(|c| !c.is_empty()) {
        Some(c) => c.to_owned(),
        None if config.contexts.len() == 1 => config.contexts[0].name.clone(),
        None => return Err(bad("names no current-context; set spec.context to one of its contexts".into())),
    };
    let ctx = config.contexts.iter().find(|c| c.name == context_name).ok_or_else(|| bad(format!("has no context {context_name:?}")))?;
    let at = format!("context {context_name:?}");
    let cluster = config
        .clusters
        .iter()
        .find(|c| c.name == ctx.context.cluster)
        .ok_or_else(|| bad(format!("{at} names cluster {:?}, which it does not define", ctx.context.cluster)))?;
    let user = config
        .users
        .iter()
        .find(|u| u.name == ctx.context.user)
        .ok_or_else(|| bad(format!("{at} names user {:?}, which it does not define", ctx.context.user)))?;

    let c = &cluster.cluster;
    let server = url::Url::parse(&c.server).map_err(|e| bad(format!("{at}: server {:?} is not a URL: {e}", c.server)))?;
    if server.scheme() != "https" || server.host_str().is_none() {
        return Err(bad(format!("{at}: server {:?} must be an https:// URL", c.server)));
    }
    if c.insecure_skip_tls_verify {
        return Err(bad(format!("{at}: insecure-skip-tls-verify is refused: the controller verifies the API server")));
    }
    if c.proxy_url.is_some() {
        return Err(bad(format!("{at}: proxy-url is not supported; the controller connects to the server directly")));
    }
    let ca_pem = match (&c.certificate_authority_data, &c.certificate_authority) {
        (Some(data), _) => decode_data(&format!("{at}: certificate-authority-data"), data)?,
        (None, Some(path)) => {
            return Err(bad(format!("{at}: certificate-authority is a file ({path}) on the machine that wrote it; {FLATTEN}")));
        }
        (None, None) => return Err(bad(format!("{at}: cluster {:?} has no certificate-authority-data", cluster.name))),
    };

    let u = &user.user;
    let who = format!("{at}: user {:?}", user.name);
    if u.exec.is_some() || u.auth_provider.is_some() {
        return Err(bad(format!(
            "{who} signs in through a plugin (exec or auth-provider), which runs on the machine that wrote it; give the controller a token or a client certificate"
        )));
    }
    if u.username.is_some() {
        return Err(bad(format!(
            "{who} uses basic authentication, which Kubernetes removed; give the controller a token or a client certificate"
        )));
    }
    if let Some(path) = u.token_file.as_ref().or(u.client_certificate.as_ref()).or(u.client_key.as_ref()) {
        return Err(bad(format!("{who} reads a file ({path}) on the machine that wrote it; {FLATTEN}")));
    }
    let credential = match (&u.token, &u.client_certificate_data, &u.client_key_data) {
        (Some(token), None, None) if !token.trim().is_empty() => Credential::Token(token.trim().to_owned()),
        (None, Some(cert), Some(key)) => Credential::ClientCertificate {
            cert_pem: decode_data(&format!("{who}: client-certificate-data"), cert)?,
            key_pem: decode_data(&format!("{who}: client-key-data"), key)?,
        },
        (None, None, None) => return Err(bad(format!("{who} has no credentials (token, or client-certificate-data and client-key-data)"))),
        _ => return Err(bad(format!("{who}: give either a token or client-certificate-data with client-key-data"))),
    };
    Ok(ClusterAccess { server: c.server.clone(), ca_pem, credential, context: context_name, user: user.name.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    fn kubeconfig(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\npreferences: {{}}\ncurrent-context: admin@prod\nclusters:\n- name: prod\n  cluster:\n{cluster}\ncontexts:\n- name: admin@prod\n  context:\n    cluster: prod\n    user: admin\nusers:\n- name: admin\n  user:\n{user}\n"
        )
    }

    fn server_and_ca() -> String {
        format!("    server: https://10.0.0.1:6443\n    certificate-authority-data: {}", b64(CA))
    }

    fn refusal(text: &str) -> String {
        match read_kubeconfig(text, None) {
            Ok(access) => panic!("accepted: {access:?}"),
            Err(e) => {
                assert_eq!(e.field(), FIELD);
                e.to_string()
            }
        }
    }

    #[test]
    fn an_embedded_token_or_client_certificate_is_read() -> Result<(), ValidationError> {
        let access = read_kubeconfig(&kubeconfig(&server_and_ca(), "    token: abc.def"), None)?;
        assert_eq!(access.server, "https://10.0.0.1:6443");
        assert_eq!(access.ca_pem, CA.as_bytes());
        assert_eq!(access.credential, Credential::Token("abc.def".into()));
        assert_eq!((access.context.as_str(), access.user.as_str()), ("admin@prod", "admin"));
        let pem = |kind: &str| format!("-----BEGIN {kind}-----\nAAAA\n-----END {kind}-----\n");
        let user =
            format!("    client-certificate-data: {}\n    client-key-data: {}", b64(&pem("CERTIFICATE")), b64(&pem("EC PRIVATE KEY")));
        let access = read_kubeconfig(&kubeconfig(&server_and_ca(), &user), Some("admin@prod"))?;
        assert_eq!(access.credential.describe(), "client certificate");
        assert_eq!(format!("{:?}", access.credential), "client certificate", "Debug shows no secret");
        Ok(())
    }

    #[test]
    fn what_a_service_cannot_use_is_refused_with_the_reason() {
        let token = "    token: abc";
        for (cluster, user, expected) in [
            (server_and_ca(), "    tokenFile: /var/run/token".to_owned(), "reads a file (/var/run/token)"),
            (server_and_ca(), "    exec:\n      command: aws".to_owned(), "signs in through a plugin"),
            (
                server_and_ca(),
                "    client-certificate: /home/me/.kube/me.crt\n    client-key: k".to_owned(),
                "reads a file (/home/me/.kube/me.crt)",
            ),
            (server_and_ca(), "    username: admin\n    password: x".to_owned(), "basic authentication"),
            (server_and_ca(), "    {}".to_owned(), "has no credentials"),
            (
                "    server: https://10.0.0.1:6443\n    certificate-authority: /etc/ca.crt".to_owned(),
                token.to_owned(),
                "certificate-authority is a file",
            ),
            (
                "    server: https://10.0.0.1:6443\n    insecure-skip-tls-verify: true".to_owned(),
                token.to_owned(),
                "insecure-skip-tls-verify is refused",
            ),
            (
                format!("    server: http://10.0.0.1:8080\n    certificate-authority-data: {}", b64(CA)),
                token.to_owned(),
                "must be an https:// URL",
            ),
            ("    server: https://10.0.0.1:6443\n    certificate-authority-data: '%%%'".to_owned(), token.to_owned(), "is not base64"),
            (
                format!("    server: https://10.0.0.1:6443\n    certificate-authority-data: {}", b64("just text")),
                token.to_owned(),
                "does not hold a PEM block",
            ),
        ] {
            let message = refusal(&kubeconfig(&cluster, &user));
            assert!(message.contains(expected), "{expected:?} not in {message:?}");
        }
        assert!(refusal("").contains("is required"));
        assert!(refusal("clusters: 3").contains("not a kubeconfig"));
        assert!(
            refusal(&kubeconfig(&server_and_ca(), "    token: abc").replace("current-context: admin@prod", "current-context: other"))
                .contains("has no context \"other\"")
        );
        assert!(
            refusal(&kubeconfig(&server_and_ca(), "    token: abc").replace("user: admin\n", "user: nobody\n"))
                .contains("names user \"nobody\"")
        );
    }
}
