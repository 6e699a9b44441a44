//! A route's `request_headers` and `response_headers`, compiled: names parsed, values that use
//! no variable made into header values once, the others split into text and variables.

use std::net::IpAddr;

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};

use crate::model::{parse_template, HeaderFilter, TemplatePart, Variable};

/// What a request gives the `${...}` variables.
pub struct Variables<'a> {
    pub client_ip: IpAddr,
    pub request_id: &'a HeaderValue,
    /// The host the client asked for, lower case, without port.
    pub host: &'a str,
    pub scheme: &'static str,
}

enum Value {
    Fixed(HeaderValue),
    Template(Box<[TemplatePart]>),
}

impl Value {
    fn compile(text: &str) -> Result<Value, String> {
        let parts = parse_template(text)?;
        if parts
            .iter()
            .all(|part| matches!(part, TemplatePart::Text(_)))
        {
            return HeaderValue::from_str(text)
                .map(Value::Fixed)
                .map_err(|_| format!("{text:?} is not a header value"));
        }
        Ok(Value::Template(parts.into()))
    }

    /// None only when a variable made the value invalid (it never does: each is a token).
    fn render(&self, variables: &Variables<'_>) -> Option<HeaderValue> {
        let parts = match self {
            Value::Fixed(value) => return Some(value.clone()),
            Value::Template(parts) => parts,
        };
        let mut text = String::new();
        for part in parts.iter() {
            match part {
                TemplatePart::Text(piece) => text.push_str(piece),
                TemplatePart::Variable(Variable::ClientIp) => {
                    text.push_str(&variables.client_ip.to_string())
                }
                TemplatePart::Variable(Variable::RequestId) => {
                    text.push_str(variables.request_id.to_str().unwrap_or(""))
                }
                TemplatePart::Variable(Variable::Host) => text.push_str(variables.host),
                TemplatePart::Variable(Variable::Scheme) => text.push_str(variables.scheme),
            }
        }
        HeaderValue::from_str(&text).ok()
    }
}

pub struct CompiledHeaderFilter {
    set: Box<[(HeaderName, Value)]>,
    add: Box<[(HeaderName, Value)]>,
    remove: Box<[HeaderName]>,
}

impl CompiledHeaderFilter {
    pub fn compile(filter: &HeaderFilter) -> Result<CompiledHeaderFilter, String> {
        let named = |map: &std::collections::BTreeMap<String, String>| {
            map.iter()
                .map(|(name, value)| Ok((header_name(name)?, Value::compile(value)?)))
                .collect::<Result<Box<[_]>, String>>()
        };
        Ok(CompiledHeaderFilter {
            set: named(&filter.set)?,
            add: named(&filter.add)?,
            remove: filter
                .remove
                .iter()
                .map(|name| header_name(name))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Removes, then sets, then adds, so a filter that removes and adds one name keeps the
    /// added value.
    pub fn apply(&self, headers: &mut HeaderMap, variables: &Variables<'_>) {
        for name in self.remove.iter() {
            headers.remove(name);
        }
        for (name, value) in self.set.iter() {
            if let Some(value) = value.render(variables) {
                headers.insert(name.clone(), value);
            }
        }
        for (name, value) in self.add.iter() {
            if let Some(value) = value.render(variables) {
                headers.append(name.clone(), value);
            }
        }
    }
}

fn header_name(name: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("{name:?} is not a header name"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_sets_and_adds_with_variables() {
        let filter = HeaderFilter {
            set: [(
                "x-client".to_owned(),
                "${client_ip} via ${scheme}://${host}".to_owned(),
            )]
            .into(),
            add: [("x-trace".to_owned(), "id-${request_id}".to_owned())].into(),
            remove: vec!["x-secret".to_owned()],
        };
        let compiled = CompiledHeaderFilter::compile(&filter).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-secret", HeaderValue::from_static("s"));
        headers.insert("x-client", HeaderValue::from_static("forged"));
        headers.insert("x-trace", HeaderValue::from_static("first"));
        let request_id = HeaderValue::from_static("r1");
        compiled.apply(
            &mut headers,
            &Variables {
                client_ip: "10.1.2.3".parse().unwrap(),
                request_id: &request_id,
                host: "api.test",
                scheme: "https",
            },
        );
        assert!(!headers.contains_key("x-secret"));
        assert_eq!(headers["x-client"], "10.1.2.3 via https://api.test");
        let traces: Vec<_> = headers.get_all("x-trace").iter().collect();
        assert_eq!(traces, ["first", "id-r1"]);
    }
}
