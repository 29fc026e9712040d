//! The configuration file: any text is a configuration or an error that
//! names a key, never a panic; the server's `[server]` table likewise.
#![no_main]

use inflight::config::Settings;
use inflight_server::Limits;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Settings::from_toml(text) {
        Ok(settings) => {
            if let Some(table) = &settings.server {
                let _ = Limits::from_table(table, &mut Vec::new());
            }
            let _ = settings.ledger.policy().classes();
        }
        Err(err) => {
            let _ = err.to_string();
        }
    }
});
