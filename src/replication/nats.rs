//! [`Changelog`] on NATS JetStream (feature `nats`): one stream, one subject per
//! replicated partition, `Nats-Expected-Last-Subject-Sequence` on every publish, the
//! stream sequence of the publish ack. `async-nats` runs on a runtime of its own (one
//! worker thread, `idemstore-nats`); the calls of the trait are synchronous, hand
//! their work to that runtime and wait for it with a bound, so they can be made from
//! any thread — a plain one, or inside the caller's own async runtime — and never
//! hang.

use std::sync::mpsc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, context::PublishErrorKind, stream};

use super::changelog::{Changelog, ChangelogError, Entry};

/// Where and how to reach the cluster, and the stream to keep the changelog in.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URLs, e.g. `nats://127.0.0.1:4222` (any of the cluster's nodes).
    pub servers: Vec<String>,
    /// The JetStream stream.
    pub stream: String,
    /// The stream's subjects: every partition's subject is below this prefix
    /// (`<prefix>.…`).
    pub subject_prefix: String,
    /// Replicas of the stream (1, 3 or 5; 3 to survive a node).
    pub replicas: usize,
    /// How long the stream keeps a message: the namespace's ttl bounds what a
    /// restore must read (restore time is bounded by the live window, not by age).
    pub max_age: Duration,
    /// The bound on every call: connect, publish and its ack, read, last.
    pub timeout: Duration,
}

impl NatsConfig {
    /// A config with the defaults: stream `IDEMSTORE`, subjects `idemstore.>`, 3
    /// replicas, 48 h of retention, 5 s per call.
    pub fn new(servers: impl IntoIterator<Item = impl Into<String>>) -> NatsConfig {
        NatsConfig {
            servers: servers.into_iter().map(Into::into).collect(),
            stream: "IDEMSTORE".into(),
            subject_prefix: "idemstore".into(),
            replicas: 3,
            max_age: Duration::from_secs(48 * 3600),
            timeout: Duration::from_secs(5),
        }
    }
}

/// Why the changelog could not be opened.
#[derive(Debug)]
pub enum NatsOpenError {
    /// No server answered within the timeout, or the connection failed.
    Unreachable(String),
    /// The stream exists with other settings (subjects, replicas, retention,
    /// storage): nothing was changed.
    Misconfigured(String),
    /// The runtime thread could not be started, or JetStream answered with an error.
    Other(String),
}

impl std::fmt::Display for NatsOpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsOpenError::Unreachable(why) => write!(f, "NATS is unreachable: {why}"),
            NatsOpenError::Misconfigured(why) => write!(f, "JetStream misconfigured: {why}"),
            NatsOpenError::Other(why) => write!(f, "NATS JetStream: {why}"),
        }
    }
}

impl std::error::Error for NatsOpenError {}

/// The changelog in a NATS JetStream stream.
pub struct NatsChangelog {
    runtime: tokio::runtime::Runtime,
    context: jetstream::Context,
    stream: stream::Stream,
    timeout: Duration,
}

impl std::fmt::Debug for NatsChangelog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsChangelog")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl NatsChangelog {
    /// Connects to the cluster and creates the stream, or checks that the existing
    /// one has the config's subjects, replicas, retention and file storage. Returns
    /// within about twice `config.timeout`.
    pub fn open(config: &NatsConfig) -> Result<NatsChangelog, NatsOpenError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("idemstore-nats")
            .enable_all()
            .build()
            .map_err(|e| NatsOpenError::Other(format!("starting its runtime: {e}")))?;
        let timeout = config.timeout;
        let wanted = stream::Config {
            name: config.stream.clone(),
            subjects: vec![format!("{}.>", config.subject_prefix)],
            num_replicas: config.replicas,
            max_age: config.max_age,
            storage: stream::StorageType::File,
            allow_direct: true,
            ..Default::default()
        };
        let servers = config.servers.clone();
        let opened = runtime.block_on(async move {
            let connect = async_nats::ConnectOptions::new()
                .connection_timeout(timeout)
                .request_timeout(Some(timeout))
                .connect(servers.as_slice());
            let client = tokio::time::timeout(timeout, connect)
                .await
                .map_err(|_| NatsOpenError::Unreachable(format!("no answer in {timeout:?}")))?
                .map_err(|e| NatsOpenError::Unreachable(e.to_string()))?;
            let mut context = jetstream::new(client);
            context.set_timeout(timeout);
            let created =
                tokio::time::timeout(timeout * 2, context.get_or_create_stream(wanted.clone()))
                    .await
                    .map_err(|_| {
                        NatsOpenError::Unreachable(format!(
                            "JetStream did not answer in {:?}",
                            timeout * 2
                        ))
                    })?
                    .map_err(|e| {
                        NatsOpenError::Other(format!("creating stream {}: {e}", wanted.name))
                    })?;
            let existing = &created.cached_info().config;
            let differs = [
                ("subjects", existing.subjects != wanted.subjects),
                ("replicas", existing.num_replicas != wanted.num_replicas),
                ("max_age", existing.max_age != wanted.max_age),
                ("storage", existing.storage != wanted.storage),
                ("allow_direct", existing.allow_direct != wanted.allow_direct),
            ];
            if let Some((field, _)) = differs.iter().find(|(_, d)| *d) {
                return Err(NatsOpenError::Misconfigured(format!(
                    "stream {} exists with another {field} (subjects {:?}, replicas {}, \
                     max_age {:?}, storage {:?}); wanted subjects {:?}, replicas {}, max_age {:?}, \
                     file storage. Nothing was changed.",
                    wanted.name,
                    existing.subjects,
                    existing.num_replicas,
                    existing.max_age,
                    existing.storage,
                    wanted.subjects,
                    wanted.num_replicas,
                    wanted.max_age
                )));
            }
            Ok((context, created))
        })?;
        Ok(NatsChangelog {
            runtime,
            context: opened.0,
            stream: opened.1,
            timeout,
        })
    }

    /// Runs `work` on the runtime thread and waits at most the timeout for it (plus
    /// a margin: `work` bounds itself with the same timeout).
    fn run<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = Result<T, ChangelogError>> + Send + 'static,
    ) -> Result<T, ChangelogError> {
        let (answer, answered) = mpsc::sync_channel(1);
        let timeout = self.timeout;
        self.runtime.spawn(async move {
            let result = tokio::time::timeout(timeout, work)
                .await
                .unwrap_or(Err(ChangelogError::Timeout));
            let _ = answer.send(result);
        });
        answered
            .recv_timeout(timeout + Duration::from_secs(1))
            .unwrap_or(Err(ChangelogError::Timeout))
    }
}

fn unavailable(e: impl std::fmt::Display) -> ChangelogError {
    ChangelogError::Unavailable(e.to_string())
}

impl Changelog for NatsChangelog {
    fn append(
        &self,
        subject: &str,
        expected_last: u64,
        message: &[u8],
    ) -> Result<u64, ChangelogError> {
        let context = self.context.clone();
        let subject = subject.to_string();
        let payload = bytes::Bytes::copy_from_slice(message);
        self.run(async move {
            // Nats-Msg-Id: the message's own hash (every message of the protocol is
            // unique: owner token and batch), so a copy JetStream lands twice within
            // the stream's duplicate window is dropped.
            let id = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&payload));
            let publish = jetstream::message::PublishMessage::build()
                .payload(payload)
                .message_id(id)
                .expected_last_subject_sequence(expected_last);
            let outcome = async { context.send_publish(subject, publish).await?.await }.await;
            match outcome {
                Ok(ack) => Ok(ack.sequence),
                Err(e) => Err(match e.kind() {
                    PublishErrorKind::WrongLastSequence => ChangelogError::WrongLastSequence,
                    PublishErrorKind::TimedOut => ChangelogError::Timeout,
                    // "No responders" during a leader election comes back as
                    // StreamNotFound: as every other failure, the outcome is unknown.
                    _ => unavailable(e),
                }),
            }
        })
    }

    fn read(&self, subject: &str, after: u64, max: usize) -> Result<Vec<Entry>, ChangelogError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let stream = self.stream.clone();
        let subject = subject.to_string();
        self.run(async move {
            use futures_util::StreamExt;
            // An ephemeral consumer over the subject from `after + 1`, no acks: the
            // fastest way JetStream 2.9 has to read many messages.
            let reader = stream
                .create_consumer(consumer::pull::Config {
                    filter_subject: subject,
                    ack_policy: consumer::AckPolicy::None,
                    deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                        start_sequence: after + 1,
                    },
                    inactive_threshold: Duration::from_secs(10),
                    ..Default::default()
                })
                .await
                .map_err(unavailable)?;
            let mut entries = Vec::new();
            while entries.len() < max {
                let want = (max - entries.len()).min(1000);
                let mut batch = reader
                    .fetch()
                    .max_messages(want)
                    .messages()
                    .await
                    .map_err(unavailable)?;
                let mut got = 0;
                while let Some(message) = batch.next().await {
                    let message = message.map_err(unavailable)?;
                    let seq = message.info().map_err(unavailable)?.stream_sequence;
                    entries.push(Entry {
                        seq,
                        message: message.payload.to_vec(),
                    });
                    got += 1;
                }
                if got < want {
                    break;
                }
            }
            Ok(entries)
        })
    }
}
