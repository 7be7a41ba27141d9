//! The API's OpenAPI 3.1 document, generated from the handlers' and
//! types' annotations; `docs/api/openapi.json` is a copy checked in, and a
//! test keeps the two equal.

use axum::response::{IntoResponse, Response};
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "tined",
        description = "tine's control plane: run, fork, checkpoint, roll back, snapshot, sleep and wake KVM microVMs. Unix socket at $TINE_HOME/tined.sock (no token), or TCP with `Authorization: Bearer KEY` (an API key, POST /v1/keys, or the token tined was started with). Errors are JSON {code, message}: 400 invalid_input, 401 unauthorized, 403 forbidden, 404 not_found, 405 method_not_allowed, 409 conflict or busy, 413 too_large, 422 conflict (an Idempotency-Key used for another request), 500 failed or internal, 503 restarting. Long work answers 202 with an Operation (Location: /v1/operations/ID).",
        license(name = "Apache-2.0")
    ),
    paths(
        crate::app::health,
        crate::app::shutdown,
        crate::openapi::serve,
        crate::app::metrics,
        crate::app::list_vms,
        crate::app::run_vm,
        crate::app::get_vm,
        crate::app::remove_vm,
        crate::app::stop_vm,
        crate::app::kill_vm,
        crate::app::fork_vm,
        crate::app::list_checkpoints,
        crate::app::create_checkpoint,
        crate::app::delete_checkpoint,
        crate::app::rollback_vm,
        crate::app::snapshot_vm,
        crate::app::sleep_vm,
        crate::keep::get_keep,
        crate::keep::put_keep,
        crate::keep::delete_keep,
        crate::app::disk_layers,
        crate::app::get_contract,
        crate::app::set_contract,
        crate::app::list_secrets,
        crate::app::add_secret,
        crate::app::vm_effects,
        crate::app::resolve_effect,
        crate::app::list_branches,
        crate::app::remove_branch,
        crate::app::wake_branch,
        crate::app::list_snapshots,
        crate::app::lineage,
        crate::app::store_tree,
        crate::app::gc,
        crate::app::verify,
        crate::app::prefetch,
        crate::app::list_hosts,
        crate::app::branch_placement,
        crate::app::move_vm,
        crate::app::forget_host,
        crate::app::host_offer,
        crate::app::list_images,
        crate::app::build_image,
        crate::app::gateway_status,
        crate::app::gateway_control,
        crate::app::list_operations,
        crate::app::get_operation,
        crate::agent_io::exec,
        crate::agent_io::attach,
        crate::agent_io::read_file,
        crate::agent_io::write_file,
        crate::agent_io::remove_file,
        crate::agent_io::stat_file,
        crate::agent_io::list_files,
        crate::agent_io::make_dir,
        crate::agent_io::move_file,
        crate::agent_io::list_processes,
        crate::agent_io::process_output,
        crate::agent_io::signal_process,
        crate::agent_io::process_stdin,
        crate::app::list_keys,
        crate::app::create_key,
        crate::app::delete_key,
        crate::agent_io::console,
        crate::agent_io::console_send,
        crate::stream::events,
        crate::stream::operation_events,
    ),
    components(schemas(crate::agent_io::ExecEvent, host::Code)),
    tags(
        (name = "vms", description = "Start, list, stop and remove vms"),
        (name = "moments", description = "Fork, checkpoint, roll back, snapshot"),
        (name = "tree", description = "Sleep, wake, branches, snapshots, gc"),
        (name = "fleet", description = "Hosts sharing one metadata database and store"),
        (name = "agent", description = "Exec and files inside a vm"),
        (name = "contract", description = "Fork contracts and secrets"),
        (name = "effects", description = "The effects journal and gateway"),
        (name = "operations", description = "Long work answered with an id"),
        (name = "events", description = "Lifecycle events"),
        (name = "images", description = "Guest images"),
        (name = "meta", description = "Health, metrics, this document"),
    )
)]
pub struct ApiDoc;

/// The document as served (pretty JSON, with a final newline).
pub fn document() -> String {
    let mut s = ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    s.push('\n');
    s
}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "meta",
    responses((status = 200, description = "This API's OpenAPI 3.1 document")))]
pub async fn serve() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        document(),
    )
        .into_response()
}
