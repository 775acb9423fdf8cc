//! Helpers shared by the process tests.

/// A port nothing listens on now, never handed out twice in this process nor next to one that
/// was (the tests run in parallel, and an engine's decode side channel takes the KV port + 1).
/// It lies below the OS's ephemeral range, so no outgoing connection of a test or of an engine
/// takes it (or the port after it) between this call and the server's bind.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    // A different start per test process, so binaries that run at once rarely meet.
    let mut port = 20_000 + (std::process::id() % 1_000) as u16 * 12;
    loop {
        port = if port >= 32_000 { 20_000 } else { port + 2 };
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if !given.iter().any(|g| g.abs_diff(port) <= 1) && free(port) && free(port + 1) {
            given.push(port);
            return port;
        }
    }
}
