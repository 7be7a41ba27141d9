//! `tine-gateway --home DIR`: the effects gateway in the foreground (what
//! `tine gateway serve` runs; the crate's tests start this binary).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let home = match args.as_slice() {
        [flag, dir] if flag == "--home" => std::path::PathBuf::from(dir),
        _ => {
            eprintln!("usage: tine-gateway --home DIR");
            return ExitCode::from(2);
        }
    };
    let served = effects::gateway::Options::from_env(&home).and_then(effects::gateway::serve);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tine gateway: {e}");
            ExitCode::FAILURE
        }
    }
}
