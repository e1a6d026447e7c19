//! The async URL check: real DNS resolution (through the system resolver, which answers
//! `localhost` from /etc/hosts without network) and address classification.

use std::net::IpAddr;

use inventory::url_policy::{AddressClass, UrlError, UrlPolicy, resolve_public, vet_url};

#[tokio::test]
async fn refuses_internal_hosts_and_literals() {
    let policy = UrlPolicy::default();
    let cases = [
        (
            "https://127.0.0.1/r.git",
            "127.0.0.1",
            AddressClass::Loopback,
        ),
        ("https://[::1]/r.git", "::1", AddressClass::Loopback),
        ("https://10.0.0.1/r.git", "10.0.0.1", AddressClass::Private),
        (
            "https://169.254.169.254/latest/meta-data",
            "169.254.169.254",
            AddressClass::LinkLocal,
        ),
        (
            "https://192.168.1.1/r.git",
            "192.168.1.1",
            AddressClass::Private,
        ),
        (
            "https://100.100.100.200/r.git",
            "100.100.100.200",
            AddressClass::SharedCgnat,
        ),
        (
            "https://[fd12:3456::1]/r.git",
            "fd12:3456::1",
            AddressClass::UniqueLocal,
        ),
    ];
    for (url, address, class) in cases {
        match vet_url(url, &policy).await {
            Err(UrlError::ForbiddenAddress {
                address: got,
                class: got_class,
                ..
            }) => {
                assert_eq!(got, address.parse::<IpAddr>().unwrap(), "{url}");
                assert_eq!(got_class, class, "{url}");
            }
            other => panic!("{url}: {other:?}"),
        }
    }
    // `localhost` is refused by name before any lookup…
    assert!(matches!(
        vet_url("https://localhost/r.git", &policy).await,
        Err(UrlError::InternalHostName { .. })
    ));
    // …and also by what it resolves to.
    match resolve_public("localhost", 443, &policy).await {
        Err(UrlError::ResolvesToForbiddenAddress {
            host,
            address,
            class,
        }) => {
            assert_eq!(host, "localhost");
            assert!(address.is_loopback(), "{address}");
            assert_eq!(class, AddressClass::Loopback);
            let message = UrlError::ResolvesToForbiddenAddress {
                host,
                address,
                class,
            }
            .to_string();
            // Neither the address nor its class is told: a caller must not learn what an
            // internal name resolves to.
            assert_eq!(
                message,
                "host `localhost` resolves to an address that is not public; only public hosts \
                 are allowed"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn accepts_public_literals_and_private_hosts_when_allowed() {
    let policy = UrlPolicy::default();
    let vetted = vet_url("https://93.184.216.34/owner/repo.git", &policy)
        .await
        .unwrap();
    assert_eq!(
        vetted.addresses(),
        ["93.184.216.34".parse::<IpAddr>().unwrap()]
    );
    assert_eq!(vetted.curl_resolve_pin(), None);
    let vetted = vet_url("https://[2606:4700:4700::1111]/r.git", &policy)
        .await
        .unwrap();
    assert_eq!(vetted.addresses().len(), 1);

    let open = UrlPolicy {
        allow_private_hosts: true,
        ..UrlPolicy::default()
    };
    let addresses = resolve_public("localhost", 443, &open).await.unwrap();
    assert!(addresses.iter().all(IpAddr::is_loopback), "{addresses:?}");
    let vetted = vet_url("https://localhost/r.git", &open).await.unwrap();
    let pin = vetted.curl_resolve_pin().unwrap();
    assert!(pin.starts_with("localhost:443:"), "{pin}");
}
