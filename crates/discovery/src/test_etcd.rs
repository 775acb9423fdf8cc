//! Real etcd clusters on loopback for tests (Debian's etcd-server; `.ci/run` installs it): one
//! or several members, each stopped and started again at will, their data removed when dropped.
//! Without an `etcd` binary [`EtcdCluster::start`] says so and answers `None`, unless the caller
//! requires etcd (the tests do where TANDEM_REQUIRE_ETCD is set, as CI sets it).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One etcd member on loopback, with its data in a directory of its own.
pub struct Member {
    name: String,
    client: u16,
    peer: u16,
    dir: PathBuf,
    cluster: String,
    child: Option<Child>,
}

impl Member {
    /// Starts it (again, on the data it has, when `new_cluster` is false).
    pub fn start(&mut self, new_cluster: bool) {
        let url = |port: u16| format!("http://127.0.0.1:{port}");
        let child = Command::new("etcd")
            .args(["--name", &self.name, "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &url(self.client), "--advertise-client-urls", &url(self.client)])
            .args(["--listen-peer-urls", &url(self.peer), "--initial-advertise-peer-urls", &url(self.peer)])
            .args(["--initial-cluster", &self.cluster])
            .args(["--initial-cluster-state", if new_cluster { "new" } else { "existing" }])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting etcd");
        self.child = Some(child);
    }

    /// Kills it (as a crash would).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A cluster's members.
pub struct EtcdCluster {
    /// Each member, to stop and start.
    pub members: Vec<Member>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(0)
}

impl EtcdCluster {
    /// `n` members, started and answering writes (bounded: 20 s); `None` without etcd, unless
    /// `required` (then a panic).
    pub async fn start(n: usize, required: bool) -> Option<Self> {
        if Command::new("etcd").arg("--version").output().is_err() {
            assert!(!required, "etcd is required here (TANDEM_REQUIRE_ETCD) but this machine has none");
            eprintln!("no etcd on this machine (Debian: apt-get install etcd-server): skipped");
            return None;
        }
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> =
            ports.iter().enumerate().map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}")).collect();
        let mut members: Vec<Member> = ports
            .iter()
            .enumerate()
            .map(|(i, &(client, peer))| Member {
                name: format!("m{i}"),
                client,
                peer,
                dir: std::env::temp_dir().join(format!("tandem-etcd-{}-{client}", std::process::id())),
                cluster: initial.join(","),
                child: None,
            })
            .collect();
        for m in &mut members {
            m.start(true);
        }
        let cluster = Self { members };
        let deadline = Instant::now() + Duration::from_secs(20);
        let endpoints = cluster.endpoints();
        let put = || async {
            let mut c = etcd_client::Client::connect(&endpoints, None).await?;
            c.put("/tandem-test/up", "1", None).await
        };
        while put().await.is_err() {
            assert!(Instant::now() < deadline, "etcd did not come up within 20 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some(cluster)
    }

    /// `host:port` of each member's client port.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| format!("127.0.0.1:{}", m.client)).collect()
    }

    /// The `--discovery` URL naming every member.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }
}
