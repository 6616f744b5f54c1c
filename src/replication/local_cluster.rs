//! A NATS JetStream cluster of `nats-server` processes on loopback, in a directory of
//! its own, for tests, benchmarks and the demo (feature `nats`). Real servers, real
//! Raft: nothing is simulated. Every node is SIGKILLed and the directory deleted when
//! the value is dropped.

use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::nats::{NatsChangelog, NatsConfig, NatsOpenError};

/// `nats-server` nodes with JetStream, clustered on loopback ports of their own.
#[derive(Debug)]
pub struct LocalCluster {
    binary: PathBuf,
    nodes: Vec<Option<Child>>,
    args: Vec<Vec<String>>,
    client_ports: Vec<u16>,
    monitor_ports: Vec<u16>,
    dir: PathBuf,
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The `nats-server` binary: `/usr/sbin/nats-server` (Debian's package), or the
/// first on `PATH`.
pub fn nats_server_binary() -> Option<PathBuf> {
    let debian = Path::new("/usr/sbin/nats-server");
    if debian.exists() {
        return Some(debian.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.exists())
    })
}

impl LocalCluster {
    /// Starts `nodes` JetStream nodes clustered on loopback (free ports, a fresh
    /// directory under the system's temporary directory). `NotFound` when
    /// `nats-server` is not installed, saying how to install it.
    pub fn start(nodes: usize) -> io::Result<LocalCluster> {
        let binary = nats_server_binary().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "nats-server is not installed (Debian: apt-get install nats-server)",
            )
        })?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("idemstore-nats-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let ports = |n| {
            (0..n)
                .map(|_| free_port())
                .collect::<io::Result<Vec<u16>>>()
        };
        let (client_ports, route_ports, monitor_ports) =
            (ports(nodes)?, ports(nodes)?, ports(nodes)?);
        let routes = route_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let args = (0..nodes)
            .map(|i| {
                [
                    "-js",
                    "-sd",
                    &dir.join(format!("n{i}")).display().to_string(),
                    "-n",
                    &format!("n{i}"),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &client_ports[i].to_string(),
                    "-m",
                    &monitor_ports[i].to_string(),
                    "--cluster_name",
                    "idemstore-local",
                    "--cluster",
                    &format!("nats://127.0.0.1:{}", route_ports[i]),
                    "--routes",
                    &routes,
                ]
                .map(str::to_string)
                .to_vec()
            })
            .collect();
        let mut cluster = LocalCluster {
            binary,
            nodes: (0..nodes).map(|_| None).collect(),
            args,
            client_ports,
            monitor_ports,
            dir,
        };
        for i in 0..nodes {
            cluster.start_node(i)?;
        }
        Ok(cluster)
    }

    /// Starts node `i` again (after [`LocalCluster::kill_node`]), on its own ports
    /// and data.
    pub fn start_node(&mut self, i: usize) -> io::Result<()> {
        if self.nodes[i].is_none() {
            let child = Command::new(&self.binary)
                .args(&self.args[i])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            self.nodes[i] = Some(child);
        }
        Ok(())
    }

    /// SIGKILLs node `i` and waits for it.
    pub fn kill_node(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The process ids of the nodes running now (for benchmarks that account for
    /// the servers' CPU time).
    pub fn pids(&self) -> Vec<u32> {
        self.nodes.iter().flatten().map(Child::id).collect()
    }

    /// Client URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.client_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect()
    }

    /// The node that leads `stream` now, asked of a running node's monitoring
    /// endpoint (`/jsz?streams=true`); `None` if no node says.
    pub fn stream_leader(&self, stream: &str) -> Option<usize> {
        use std::io::{Read, Write};
        for (i, port) in self.monitor_ports.iter().enumerate() {
            if self.nodes[i].is_none() {
                continue;
            }
            let Ok(mut http) = std::net::TcpStream::connect(("127.0.0.1", *port)) else {
                continue;
            };
            let _ = http.set_read_timeout(Some(Duration::from_secs(2)));
            let request = "GET /jsz?streams=true HTTP/1.0\r\nHost: localhost\r\n\r\n";
            if http.write_all(request.as_bytes()).is_err() {
                continue;
            }
            let mut body = String::new();
            let _ = http.read_to_string(&mut body);
            body.retain(|c| !c.is_whitespace());
            // ... "name":"<stream>", ... "cluster":{ ... "leader":"n<i>" ...
            let at = body.find(&format!("\"name\":\"{stream}\""))?;
            let rest = &body[at..];
            let leader = rest.find("\"leader\":\"n")?;
            let digit = rest[leader + 11..].chars().next()?;
            return digit.to_digit(10).map(|d| d as usize);
        }
        None
    }

    /// Opens `config`'s changelog on this cluster, retrying for up to `patience`
    /// while the nodes start and elect their first leaders.
    pub fn open(
        &self,
        config: &NatsConfig,
        patience: Duration,
    ) -> Result<NatsChangelog, NatsOpenError> {
        let started = Instant::now();
        loop {
            match NatsChangelog::open(config) {
                Err(NatsOpenError::Misconfigured(why)) => {
                    return Err(NatsOpenError::Misconfigured(why));
                }
                Err(_) if started.elapsed() < patience => {
                    std::thread::sleep(Duration::from_millis(200))
                }
                other => return other,
            }
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill_node(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
