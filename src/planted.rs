//! The bugs of the negative controls (`.ci/negative-controls`): listed with the
//! feature `testing`, compiled into the engine only with the feature `planted-bugs`, each switched on at run time by
//! `IDEMSTORE_PLANTED_BUG=<name>`. The reliability tests must fail with each. A leaf:
//! the engine modules that carry a bug ask `planted(name)`.

/// The environment variable that selects a planted bug (feature `planted-bugs`).
pub const PLANTED_BUG_ENV: &str = "IDEMSTORE_PLANTED_BUG";

/// The bugs the `planted-bugs` feature can plant, one at a time, for the negative
/// controls: the reliability tests must fail with each.
pub const PLANTED_BUGS: [&str; 16] = [
    // Commit tickets (blocking waits and futures) are answered before the sync completes.
    "ack-before-fsync",
    // Log::sync never syncs the directory, so new segment files can vanish.
    "skip-dir-fsync",
    // Log::sync ignores a failed segment fdatasync: no poisoning, the round succeeds.
    "ignore-fsync-error",
    // The scan treats the first damaged record as the end even if valid ones follow.
    "eager-torn-tail",
    // expiry::deadline::bucket_deadline rounds one step early.
    "early-expiry",
    // replication: a writer that finds another owner's message at the end of the
    // subject catches up to it and appends again instead of taking itself as fenced.
    "zombie-catches-up",
    // replication: a Sync write answers before its record is stored by the cluster.
    "sync-acks-before-ship",
    // cold tier: a key missing from the hot table is not looked up in the generations.
    "cold-lookup-skipped",
    // cold tier: a write that shadows a cold entry leaves that entry's state counted.
    "cold-shadow-uncounted",
    // cold tier: a write that shadows a cold entry leaves that entry live, so a
    // re-created key whose chain expires first finds its old state again.
    "cold-shadow-not-killed",
    // cold tier: a merge drops the kills writers made in the two generations after
    // it read their dead bits, so a killed entry answers again from the merged one.
    "cold-merge-loses-kills",
    // cold tier: an open that reuses the generations of a clean close forgets their
    // dead bits, so killed entries answer again.
    "cold-state-forgets-kills",
    // cold tier: a cold state written while the store runs does not wait for the log
    // to be durable, so it can hold a kill whose record a power cut loses.
    "cold-state-before-durable",
    // cold tier: an open after a crash that reuses the generations skips the
    // reconciliation, so the kills the writes after the last cold state made are lost.
    "cold-crash-skips-reconcile",
    // cold tier: the replay's screen never reports a key a filter may hold, so the
    // reconciliation after a crash reads no entry and the kills are lost again.
    "cold-screen-drops-hits",
    // approximate mode: a generation with an expired bucket is trusted all the same,
    // so an expired key of an approximate namespace answers LikelyDuplicate.
    "approximate-trusts-expired",
];

/// Whether the planted bug `name` is switched on (always false without the feature).
#[cfg(feature = "planted-bugs")]
pub(crate) fn planted(name: &str) -> bool {
    static BUG: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let bug = BUG.get_or_init(|| {
        let bug = std::env::var(PLANTED_BUG_ENV)
            .ok()
            .filter(|b| !b.is_empty());
        if let Some(bug) = &bug {
            assert!(
                PLANTED_BUGS.contains(&bug.as_str()),
                "{PLANTED_BUG_ENV}={bug} is not one of {PLANTED_BUGS:?}"
            );
        }
        bug
    });
    debug_assert!(PLANTED_BUGS.contains(&name));
    bug.as_deref() == Some(name)
}
