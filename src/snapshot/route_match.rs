//! A route's conditions on headers, query parameters and cookies, compiled once per snapshot
//! (regexes included) and tested against a request only when its host and path already chose
//! the route as a candidate (TRAFFIC.md §3).

use std::borrow::Cow;

use http::header::{HeaderName, COOKIE};
use http::{HeaderMap, Method};
use percent_encoding::percent_decode_str;
use regex::Regex;

use crate::model::{whole_value_regex, Condition, ConditionTest, Route};

/// What a route's conditions look at in a request.
pub struct RequestView<'a> {
    pub method: &'a Method,
    pub headers: &'a HeaderMap,
    /// The raw query string, without `?`.
    pub query: Option<&'a str>,
}

/// How one value is tested.
enum Test {
    Value(Box<str>),
    Regex(Regex),
    Present(bool),
}

impl Test {
    fn compile(condition: &Condition, field: &str) -> Result<Test, String> {
        Ok(match condition.test() {
            ConditionTest::Value(value) => Test::Value(value.into()),
            ConditionTest::Regex(pattern) => Test::Regex(
                whole_value_regex(pattern).map_err(|reason| format!("{field}.regex: {reason}"))?,
            ),
            ConditionTest::Present(present) => Test::Present(present),
        })
    }

    /// `value` is what the request carries under the name, if anything.
    fn holds(&self, value: Option<&str>) -> bool {
        match (self, value) {
            (Test::Present(present), value) => value.is_some() == *present,
            (Test::Value(expected), Some(value)) => **expected == *value,
            (Test::Regex(regex), Some(value)) => regex.is_match(value),
            (_, None) => false,
        }
    }
}

/// Every condition of one route; all must hold.
pub struct Conditions {
    headers: Box<[(HeaderName, Test)]>,
    query: Box<[(Box<str>, Test)]>,
    cookies: Box<[(Box<str>, Test)]>,
}

impl Conditions {
    /// Fails only for a route stored before validation could refuse what it says.
    pub fn compile(route: &Route) -> Result<Conditions, String> {
        let headers = route
            .headers
            .iter()
            .enumerate()
            .map(|(index, condition)| {
                let name = HeaderName::from_bytes(condition.name.as_bytes())
                    .map_err(|_| format!("headers[{index}].name {:?}", condition.name))?;
                Ok((
                    name,
                    Test::compile(condition, &format!("headers[{index}]"))?,
                ))
            })
            .collect::<Result<_, String>>()?;
        let named = |field: &str, conditions: &[Condition]| {
            conditions
                .iter()
                .enumerate()
                .map(|(index, condition)| {
                    let test = Test::compile(condition, &format!("{field}[{index}]"))?;
                    Ok((condition.name.as_str().into(), test))
                })
                .collect::<Result<Box<[_]>, String>>()
        };
        Ok(Conditions {
            headers,
            query: named("query", &route.query)?,
            cookies: named("cookies", &route.cookies)?,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.headers.is_empty() && self.query.is_empty() && self.cookies.is_empty()
    }

    /// Header and cookie conditions, which rank a route before query conditions do.
    pub fn header_and_cookie_count(&self) -> usize {
        self.headers.len() + self.cookies.len()
    }

    pub fn query_count(&self) -> usize {
        self.query.len()
    }

    pub fn hold_for(&self, request: &RequestView<'_>) -> bool {
        self.headers.iter().all(|(name, test)| {
            // Several fields of one name are one comma-joined value (RFC 9110 §5.3).
            let mut values = request.headers.get_all(name).iter();
            let value = match (values.next(), values.next()) {
                (None, _) => None,
                (Some(only), None) => Some(Cow::Borrowed(only.to_str().unwrap_or("\u{fffd}"))),
                (Some(first), Some(second)) => {
                    let mut joined = String::from_utf8_lossy(first.as_bytes()).into_owned();
                    for more in std::iter::once(second).chain(values) {
                        joined.push_str(", ");
                        joined.push_str(&String::from_utf8_lossy(more.as_bytes()));
                    }
                    Some(Cow::Owned(joined))
                }
            };
            test.holds(value.as_deref())
        }) && self
            .query
            .iter()
            .all(|(name, test)| test.holds(query_value(request.query, name).as_deref()))
            && self
                .cookies
                .iter()
                .all(|(name, test)| test.holds(cookie_value(request.headers, name)))
    }
}

/// The first value of a query parameter, percent-decoded (`+` is a space, as forms send it).
pub fn query_value<'a>(query: Option<&'a str>, name: &str) -> Option<Cow<'a, str>> {
    query?.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(key) == name).then(|| decode(value))
    })
}

fn decode(text: &str) -> Cow<'_, str> {
    if !text.contains(['%', '+']) {
        return Cow::Borrowed(text);
    }
    let spaced = text.replace('+', " ");
    Cow::Owned(percent_decode_str(&spaced).decode_utf8_lossy().into_owned())
}

/// A cookie's value from the request's `Cookie` fields (RFC 6265 §5.4: `name=value; ...`).
pub fn cookie_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .find_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            (key.trim() == name).then(|| value.trim().trim_matches('"'))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn query_values_are_the_first_and_decoded() {
        let query = Some("a=1&b=x%20y&a=2&c&d=p+q");
        assert_eq!(query_value(query, "a").as_deref(), Some("1"));
        assert_eq!(query_value(query, "b").as_deref(), Some("x y"));
        assert_eq!(query_value(query, "c").as_deref(), Some(""));
        assert_eq!(query_value(query, "d").as_deref(), Some("p q"));
        assert_eq!(query_value(query, "e"), None);
        assert_eq!(query_value(None, "a"), None);
    }

    #[test]
    fn cookies_are_found_in_every_cookie_field() {
        let mut headers = HeaderMap::new();
        headers.append(COOKIE, HeaderValue::from_static("a=1; session=abc"));
        headers.append(COOKIE, HeaderValue::from_static("beta=\"yes\""));
        assert_eq!(cookie_value(&headers, "session"), Some("abc"));
        assert_eq!(cookie_value(&headers, "beta"), Some("yes"));
        assert_eq!(cookie_value(&headers, "sess"), None);
    }
}
