fn main() {
    println!("inflight: the server arrives with `inflight serve`");
}
