//! The dashboard: the static files under `ui/`, embedded into the binary with `include_bytes!`
//! and served at `/ui/` on the admin listener. They hold no data and need no token; the page
//! reads everything from the API with the token its user signs in with.
//!
//! `/ui` redirects to `/ui/`; a path under `/ui/` that names no file answers the admin API's
//! JSON 404 (the page routes with the URL fragment, so no deep link needs `index.html`). Every
//! file goes out with its content type, `Cache-Control: no-cache` (revalidated with its ETag) and
//! a strict Content-Security-Policy: scripts, styles and connections only from the gateway
//! itself, no inline script, no frames.

use std::sync::OnceLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};

use super::ApiError;

/// What the dashboard may load and connect to: only this origin; nothing inline.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const ASSETS: &[Asset] = &[
    Asset {
        name: "index.html",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../../ui/index.html"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../ui/app.js"),
    },
    Asset {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../../ui/style.css"),
    },
    Asset {
        name: "favicon.svg",
        content_type: "image/svg+xml",
        body: include_bytes!("../../ui/favicon.svg"),
    },
];

/// The dashboard's routes (`/ui`, `/ui/`, `/ui/{file}`), to merge into the admin router.
pub fn router() -> Router<super::AdminState> {
    routes()
}

/// The routes need no state, so they build for any.
fn routes<S>() -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    Router::new()
        // Relative, so it also works behind a proxy that serves the admin API under a prefix.
        .route("/ui", get(|| async { Redirect::permanent("ui/") }))
        .route("/ui/", get(|headers: HeaderMap| async move { serve("index.html", &headers) }))
        .route(
            "/ui/{*file}",
            get(|Path(file): Path<String>, headers: HeaderMap| async move {
                serve(&file, &headers)
            }),
        )
}

fn serve(name: &str, headers: &HeaderMap) -> Response {
    let Some((index, asset)) = ASSETS
        .iter()
        .enumerate()
        .find(|(_, asset)| asset.name == name)
    else {
        return ApiError::NotFound {
            message: format!("no such dashboard file: /ui/{name}"),
        }
        .into_response();
    };
    let etag = etag(index);
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|tags| {
            tags.split(',')
                .any(|tag| tag.trim() == etag || tag.trim() == "*")
        });
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        let mut response = asset.body.into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(asset.content_type),
        );
        response
    };
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(value) = HeaderValue::from_str(etag) {
        headers.insert(header::ETAG, value);
    }
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

/// A strong ETag per file: the start of its SHA-256, computed once.
fn etag(index: usize) -> &'static str {
    static ETAGS: OnceLock<Vec<String>> = OnceLock::new();
    &ETAGS.get_or_init(|| {
        ASSETS
            .iter()
            .map(|asset| format!("\"{}\"", &hex::encode(Sha256::digest(asset.body))[..20]))
            .collect()
    })[index]
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn get(path: &str, if_none_match: Option<&str>) -> Response {
        let mut request = Request::get(path);
        if let Some(tag) = if_none_match {
            request = request.header(header::IF_NONE_MATCH, tag);
        }
        routes::<()>()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    fn header_of(response: &Response, name: header::HeaderName) -> &str {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }

    #[tokio::test]
    async fn files_have_their_types_and_strict_headers() {
        for (path, content_type) in [
            ("/ui/", "text/html; charset=utf-8"),
            ("/ui/index.html", "text/html; charset=utf-8"),
            ("/ui/app.js", "text/javascript; charset=utf-8"),
            ("/ui/style.css", "text/css; charset=utf-8"),
            ("/ui/favicon.svg", "image/svg+xml"),
        ] {
            let response = get(path, None).await;
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            assert_eq!(header_of(&response, header::CONTENT_TYPE), content_type);
            assert_eq!(header_of(&response, header::CACHE_CONTROL), "no-cache");
            let csp = header_of(&response, header::CONTENT_SECURITY_POLICY);
            assert!(csp.contains("script-src 'self'"), "{csp}");
            assert!(!csp.contains("unsafe-inline"), "{csp}");
            assert_eq!(
                header_of(&response, header::X_CONTENT_TYPE_OPTIONS),
                "nosniff"
            );
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert!(!body.is_empty(), "{path}");
        }
        let page = get("/ui/", None).await.into_body().collect().await.unwrap();
        let page = String::from_utf8(page.to_bytes().to_vec()).unwrap();
        assert!(page.contains(r#"<script type="module" src="app.js">"#));
        // No inline script or style: the CSP would refuse it.
        assert_eq!(page.matches("<script").count(), 1, "{page}");
        assert!(
            !page.contains("<style") && !page.contains("style="),
            "{page}"
        );
    }

    #[tokio::test]
    async fn the_bare_path_redirects_and_unknown_files_are_404() {
        let response = get("/ui", None).await;
        assert_eq!(response.status(), StatusCode::PERMANENT_REDIRECT);
        assert_eq!(header_of(&response, header::LOCATION), "ui/");

        for path in ["/ui/nope.js", "/ui/../Cargo.toml", "/ui/assets/app.js"] {
            let response = get(path, None).await;
            assert_eq!(response.status(), StatusCode::NOT_FOUND, "{path}");
            assert!(header_of(&response, header::CONTENT_TYPE).starts_with("application/json"));
        }
    }

    #[tokio::test]
    async fn an_unchanged_file_revalidates_with_304() {
        let first = get("/ui/app.js", None).await;
        let tag = header_of(&first, header::ETAG).to_owned();
        assert!(tag.starts_with('"') && tag.len() > 10, "{tag}");
        let again = get("/ui/app.js", Some(&tag)).await;
        assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(header_of(&again, header::ETAG), tag);
        let other = get("/ui/app.js", Some("\"something-else\"")).await;
        assert_eq!(other.status(), StatusCode::OK);
    }
}
