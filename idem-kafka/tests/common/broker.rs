//! A tansu broker of a test's own (`IDEM_TANSU_BIN`), for the broker-fault tests: on S3
//! storage (`IDEM_S3_ENDPOINT`, moto's server) so that a restart after `kill -9` finds its
//! log again, or in memory; listening on a port of its own and advertising either that
//! port or another address (a proxy's) in its metadata.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running tansu; dropping it kills it.
pub struct Broker {
    bin: String,
    /// `--storage-engine`.
    storage: String,
    /// The S3 endpoint, for S3 storage.
    endpoint: Option<String>,
    port: u16,
    /// `host:port` given to clients in metadata.
    advertised: String,
    child: Option<Child>,
}

/// A free loopback port (free when asked: nothing holds it afterwards).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl Broker {
    /// A broker whose log is in a new bucket of the S3 server at `endpoint`, on a free port
    /// it advertises itself.
    pub async fn on_s3(bin: String, endpoint: String) -> Broker {
        let bucket = super::unique("tansu").replace('_', "-").to_lowercase();
        create_bucket(&endpoint, &bucket).await;
        let port = free_port();
        let mut broker = Broker {
            bin,
            storage: format!("s3://{bucket}/"),
            endpoint: Some(endpoint),
            port,
            advertised: format!("127.0.0.1:{port}"),
            child: None,
        };
        broker.spawn().await;
        broker
    }

    /// A broker with its log in memory, listening on `port` and advertising `advertised`
    /// (`host:port`) as its address: clients that bootstrap anywhere then talk to it there.
    pub async fn in_memory(bin: String, port: u16, advertised: &str) -> Broker {
        let mut broker = Broker {
            bin,
            storage: "memory://tansu/".to_owned(),
            endpoint: None,
            port,
            advertised: advertised.to_owned(),
            child: None,
        };
        broker.spawn().await;
        broker
    }

    /// Where the broker listens.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the broker on its storage and waits until it accepts connections.
    pub async fn spawn(&mut self) {
        let mut command = Command::new(&self.bin);
        command
            .args(["broker", "--storage-engine", &self.storage])
            .arg("--listener-url")
            .arg(format!("tcp://{}", self.address()))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://{}", self.advertised))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(endpoint) = &self.endpoint {
            command
                .env("AWS_ENDPOINT", endpoint)
                .env("AWS_ALLOW_HTTP", "true")
                .env("AWS_ACCESS_KEY_ID", "idem")
                .env("AWS_SECRET_ACCESS_KEY", "idem")
                .env("AWS_DEFAULT_REGION", "us-east-1")
                .env("AWS_REGION", "us-east-1");
        }
        self.child = Some(command.spawn().expect("start tansu (IDEM_TANSU_BIN)"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(self.address())
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "tansu did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `kill -9`: no clean shutdown of any kind.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Creates `bucket` with one unsigned `PUT` (moto does not check signatures).
async fn create_bucket(endpoint: &str, bucket: &str) {
    let host = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut conn = tokio::net::TcpStream::connect(host)
        .await
        .expect("connect to IDEM_S3_ENDPOINT");
    let request = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await.expect("PUT");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("answer");
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "create bucket: {answer}"
    );
}
