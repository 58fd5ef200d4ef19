// ProxyWindows: the windows a rank's commands name, kept by a StagingBackend wrapped around
// the caller's transport (staging_backend.h); window ids are that backend's.
#include "mkernel/proxy/windows.h"

#include "mkernel/common/check.h"
#include "mkernel/runtime/bootstrap.h"
#include "src/proxy/staging_backend.h"

namespace mk {
namespace {

class StagedWindows final : public ProxyWindows {
 public:
  explicit StagedWindows(std::unique_ptr<StagingBackend> be) : be_(std::move(be)) {}
  ~StagedWindows() override { (void)destroy(); }

  Status add(void* base, uint64_t bytes, net::MemKind kind, uint32_t* id) override {
    MK_REQUIRE(!destroyed_, Code::kInvalidArgument, "ProxyWindows: add after destroy");
    net::WindowId w = net::kNoWindow;
    MK_CHECK(be_->register_window(base, bytes, kind, &w));
    *id = w;
    return OkStatus();
  }
  Status destroy() override {
    if (destroyed_) return OkStatus();
    destroyed_ = true;
    return be_->finalize();
  }
  bool staging() const override { return be_->staging(); }
  net::WindowId transport_id(uint32_t id) const override { return be_->transport_id(id); }
  net::Backend* backend() const override { return be_.get(); }
  int rank() const override { return be_->rank(); }
  int world() const override { return be_->world(); }

 private:
  std::unique_ptr<StagingBackend> be_;
  bool destroyed_ = false;
};

}  // namespace

Status ProxyWindows::create(Bootstrap* bs, net::Backend* transport, const std::string& staging,
                            const StagingConfig& sc, std::unique_ptr<ProxyWindows>* out) {
  MK_REQUIRE(bs && transport, Code::kInvalidArgument, "ProxyWindows needs a bootstrap and a backend");
  std::unique_ptr<StagingBackend> be;
  MK_CHECK(StagingBackend::create(bs, transport, staging, sc, &be));
  *out = std::make_unique<StagedWindows>(std::move(be));
  return OkStatus();
}

}  // namespace mk
