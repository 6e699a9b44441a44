#![forbid(unsafe_code)]
//! Raahi: a Layer-4/7 reverse-proxy gateway whose upstream targets come from service discovery.

pub mod admin;
pub mod balance;
pub mod clock;
pub mod config;
pub mod control;
pub mod discovery;
pub mod error_chain;
pub mod events;
pub mod gateway;
pub mod model;
pub mod proxy;
pub mod registration;
pub mod resources;
pub mod snapshot;
pub mod status;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod validate;
