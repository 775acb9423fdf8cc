//! Helpers shared by the process tests.

/// A port nothing listens on now, never handed out twice in this process nor next to one that
/// was (the tests run in parallel, the OS may offer a just-released port again, and an engine's
/// decode side channel takes the KV port + 1).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !given.iter().any(|p| p.abs_diff(port) <= 1) {
            given.push(port);
            return port;
        }
    }
}
