//! Discovery against a real etcd (Debian's etcd-server; `.ci/run` installs it): engines
//! registering, leaving on withdrawal and on a lapsed lease, a second engine under the same id,
//! junk under the prefix, etcd stopped and started again, and a three-node cluster losing a node.
//! Without an `etcd` binary these tests say so and pass, unless TANDEM_REQUIRE_ETCD is set
//! (`test_etcd`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_discovery::test_etcd::EtcdCluster;
use tandem_discovery::{register, watch, DiscoveryConfig, DiscoveryHealth, EngineRecord, Membership};

/// CI sets TANDEM_REQUIRE_ETCD: there a missing etcd is a failure, not a skip.
fn required() -> bool {
    std::env::var_os("TANDEM_REQUIRE_ETCD").is_some()
}

fn config(etcd: &EtcdCluster, lease_secs: u64) -> DiscoveryConfig {
    let prefix = format!("/t{}", std::process::id());
    DiscoveryConfig::parse(&etcd.url(), &prefix, Duration::from_secs(lease_secs)).unwrap()
}

fn record(id: &str, url: &str) -> EngineRecord {
    EngineRecord {
        engine_id: id.into(),
        epoch: 1,
        role: "decode".into(),
        kv_mode: "push".into(),
        model: "tiny".into(),
        fingerprint: "f".into(),
        http_url: url.into(),
        kv_address: Some("127.0.0.1:5601".into()),
        transports: vec!["tcp".into()],
        block_size: 16,
        capacity_blocks: 100,
        lease_secs: 2,
    }
}

/// Waits (at most `bound`) until the membership satisfies `ok`; how long that took.
async fn until(
    rx: &mut tokio::sync::watch::Receiver<Option<Membership>>,
    bound: Duration,
    ok: impl Fn(&Membership) -> bool,
) -> Duration {
    let start = Instant::now();
    let reached = tokio::time::timeout(bound, rx.wait_for(|m| m.as_ref().is_some_and(&ok))).await.is_ok();
    let now = rx.borrow().as_ref().map(|m| m.keys().cloned().collect::<Vec<_>>());
    assert!(reached, "membership not as expected within {bound:?}: {now:?}");
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_come_and_go_withdrawn_at_once_and_killed_within_their_lease() {
    let Some(etcd) = EtcdCluster::start(1, required()).await else { return };
    let cfg = config(&etcd, 2);
    let health = Arc::new(DiscoveryHealth::default());
    let (mut members, _watching) = watch(&cfg, health.clone()).unwrap();
    until(&mut members, Duration::from_secs(5), |m| m.is_empty()).await;
    let a = register(&cfg, record("a", "http://10.0.0.1:8200"), Arc::new(DiscoveryHealth::default())).unwrap();
    let b = register(&cfg, record("b", "http://10.0.0.2:8200"), Arc::new(DiscoveryHealth::default())).unwrap();
    until(&mut members, Duration::from_secs(5), |m| m.len() == 2).await;
    assert_eq!(members.borrow().as_ref().unwrap()["a"], record("a", "http://10.0.0.1:8200"));
    assert!(health.connected());
    // Withdrawn: gone at once (no lease to wait out).
    a.withdraw(Duration::from_secs(5)).await;
    let took = until(&mut members, Duration::from_secs(5), |m| !m.contains_key("a") && m.contains_key("b")).await;
    assert!(took < Duration::from_secs(1), "a withdrawn engine lingered {took:?}");
    // Killed (no keep-alives, no withdrawal): gone within its lease.
    let killed = Instant::now();
    drop(b);
    until(&mut members, Duration::from_secs(6), |m| m.is_empty()).await;
    let gone = killed.elapsed();
    assert!(gone <= Duration::from_millis(3500), "a killed engine stayed {gone:?} (lease 2 s)");
    eprintln!("withdrawn engine gone in {took:?}, killed engine in {gone:?} (lease 2 s)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_engine_under_the_same_id_and_junk_keys_are_never_members() {
    let Some(etcd) = EtcdCluster::start(1, required()).await else { return };
    let cfg = config(&etcd, 2);
    let (mut members, _watching) = watch(&cfg, Arc::new(DiscoveryHealth::default())).unwrap();
    let first = register(&cfg, record("dup", "http://10.0.0.1:8200"), Arc::new(DiscoveryHealth::default())).unwrap();
    until(&mut members, Duration::from_secs(5), |m| m.contains_key("dup")).await;
    let second_health = Arc::new(DiscoveryHealth::default());
    let _second = register(&cfg, record("dup", "http://10.0.0.9:8200"), second_health.clone()).unwrap();
    let mut client = etcd_client::Client::connect(&cfg.endpoints, None).await.unwrap();
    client.put(cfg.key_of("junk"), "not json", None).await.unwrap();
    client.put(cfg.key_of("liar"), serde_json::to_vec(&record("other", "http://x:1")).unwrap(), None).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while second_health.failures() == 0 {
        assert!(Instant::now() < deadline, "the second engine was not refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(second_health.last_error().contains("10.0.0.1"), "{}", second_health.last_error());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let now = members.borrow().clone().unwrap();
    assert_eq!(now.keys().collect::<Vec<_>>(), ["dup"], "junk or a mislabelled record became a member");
    assert_eq!(now["dup"].http_url, "http://10.0.0.1:8200", "the second engine displaced the first");
    // The first one restarting (same id, same address) takes its key back under a new lease.
    drop(first);
    let again = register(&cfg, record("dup", "http://10.0.0.1:8200"), Arc::new(DiscoveryHealth::default())).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(members.borrow().as_ref().unwrap()["dup"].http_url, "http://10.0.0.1:8200");
    again.withdraw(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_stopped_everyone_keeps_serving_and_it_converges_when_etcd_returns() {
    let Some(mut etcd) = EtcdCluster::start(1, required()).await else { return };
    let cfg = config(&etcd, 2);
    let (watch_health, engine_health) = (Arc::new(DiscoveryHealth::default()), Arc::new(DiscoveryHealth::default()));
    let (mut members, _watching) = watch(&cfg, watch_health.clone()).unwrap();
    let _a = register(&cfg, record("a", "http://10.0.0.1:8200"), engine_health.clone()).unwrap();
    until(&mut members, Duration::from_secs(5), |m| m.contains_key("a")).await;
    etcd.members[0].stop();
    let deadline = Instant::now() + Duration::from_secs(10);
    while watch_health.connected() || engine_health.connected() {
        assert!(Instant::now() < deadline, "nobody noticed etcd was gone");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(members.borrow().as_ref().unwrap().contains_key("a"), "the router's view was lost with etcd");
    // A change while etcd was away (an engine that registers once it is back) arrives too.
    etcd.members[0].start(false);
    let back = Instant::now();
    let _b = register(&cfg, record("b", "http://10.0.0.2:8200"), Arc::new(DiscoveryHealth::default())).unwrap();
    until(&mut members, Duration::from_secs(10), |m| m.contains_key("a") && m.contains_key("b")).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(watch_health.connected() && engine_health.connected()) {
        assert!(Instant::now() < deadline, "not reconnected to etcd");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("converged {:?} after etcd returned", back.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_member_cluster_losing_one_member_loses_nothing() {
    let Some(mut etcd) = EtcdCluster::start(3, required()).await else { return };
    let cfg = config(&etcd, 3);
    let (mut members, _watching) = watch(&cfg, Arc::new(DiscoveryHealth::default())).unwrap();
    // Six engines, so that some keep their leases alive through the member that goes (etcd's
    // client spreads its calls over every member it is given).
    let ids = ["a", "b", "c", "d", "e", "f"];
    let _engines: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let url = format!("http://10.0.0.{}:8200", i + 1);
            register(&cfg, record(id, &url), Arc::new(DiscoveryHealth::default())).unwrap()
        })
        .collect();
    until(&mut members, Duration::from_secs(10), |m| m.len() == ids.len()).await;
    etcd.members[0].stop();
    let _late = register(&cfg, record("late", "http://10.0.0.9:8200"), Arc::new(DiscoveryHealth::default())).unwrap();
    // Past two leases, every view the router is given holds every engine: none lapsed, not
    // even for a moment, and the one registering after the member went is there too.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(7);
    members.mark_changed();
    while let Ok(Ok(())) = tokio::time::timeout_at(deadline, members.changed()).await {
        let view = members.borrow_and_update().clone().unwrap();
        let lost: Vec<_> = ids.iter().filter(|id| !view.contains_key(**id)).collect();
        assert!(lost.is_empty(), "{lost:?} left the membership with one member of three down");
    }
    assert!(
        members.borrow().as_ref().unwrap().contains_key("late"),
        "an engine could not register with one member of three down"
    );
}

/// A member cut off from the others' quorum (here: the other two stopped) is left at once,
/// not followed silently: the router's watch and an engine's registration pinned to it see
/// that it has no leader and say so (then keep their last view and keep trying), and when the
/// quorum is back both are whole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_a_leader_is_not_followed_silently() {
    let Some(mut etcd) = EtcdCluster::start(3, required()).await else { return };
    let cfg = config(&etcd, 3);
    let (watch_health, engine_health) = (Arc::new(DiscoveryHealth::default()), Arc::new(DiscoveryHealth::default()));
    let (mut members, _watching) = watch(&cfg, watch_health.clone()).unwrap();
    let _a = register(&cfg, record("a", "http://10.0.0.1:8200"), engine_health.clone()).unwrap();
    until(&mut members, Duration::from_secs(10), |m| m.contains_key("a")).await;
    // The router's watch follows one member: the others stop (its quorum with them).
    let endpoints = etcd.endpoints();
    let pinned = endpoints.iter().position(|e| *e == watch_health.member()).expect("the watch names its member");
    for (i, m) in etcd.members.iter_mut().enumerate() {
        if i != pinned {
            m.stop();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while watch_health.connected() || engine_health.connected() {
        assert!(
            Instant::now() < deadline,
            "a member without a leader was still followed: watch {}, engine {}",
            watch_health.connected(),
            engine_health.connected()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(members.borrow().as_ref().unwrap().contains_key("a"), "the router's last view was lost");
    for (i, m) in etcd.members.iter_mut().enumerate() {
        if i != pinned {
            m.start(false);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(watch_health.connected() && engine_health.connected()) {
        assert!(Instant::now() < deadline, "not back once the quorum returned");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    until(&mut members, Duration::from_secs(10), |m| m.contains_key("a")).await;
}

/// A watch with nothing to report and an engine's registration stay connected while idle: 12 s,
/// over twice the 5 s etcd wants between HTTP/2 pings (closer pings made it close an idle watch
/// every few seconds, 4 times in 20 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_stay_up() {
    let Some(etcd) = EtcdCluster::start(1, required()).await else { return };
    let cfg = config(&etcd, 10);
    let (watch_health, engine_health) = (Arc::new(DiscoveryHealth::default()), Arc::new(DiscoveryHealth::default()));
    let (mut members, _watching) = watch(&cfg, watch_health.clone()).unwrap();
    let _a = register(&cfg, record("a", "http://10.0.0.1:8200"), engine_health.clone()).unwrap();
    until(&mut members, Duration::from_secs(10), |m| m.contains_key("a")).await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    for (who, h) in [("watch", &watch_health), ("registration", &engine_health)] {
        assert!(h.connected() && h.failures() == 0, "the idle {who} broke {} times: {}", h.failures(), h.last_error());
    }
}
